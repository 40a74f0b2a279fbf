"""`make demo-vision`: an image classifier on the sphere, offline, through the CLI.

No pretrained vision weights can be downloaded here, so the demo trains a small ViT on
scikit-learn's handwritten digits (real 8 x 8 scans shipped with the package; about half a
minute on two cores, tests/support/vision_models.py), saves it with its image processor, writes
held-out digits as PNG files, then ingests them with `actdb ingest --images` and asks which
digit the class token points toward at each layer: the logit lens, read through the
classifier's head (the anchor set 'classifier'). Every command is printed so that it can be
pasted into a shell as it is.

Usage: python examples/vision_demo.py [STORE] [PICTURES_FOLDER]
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "tests"))  # the digits model's trainer, shared with tests
ACTDB = Path(sys.executable).parent / "actdb"

LENS = """
-- The class token of the first held-out digit, layer by layer: the digit its direction
-- points toward through the classifier's head, with that digit's probability.
SELECT layer, site, top_logits(vec, 1)[1].token AS top,
       round(top_logits(vec, 1)[1].logit, 2) AS logit,
       round(prob(vec, top_logits(vec, 1)[1].token), 3) AS p
FROM acts WHERE prompt_id = 0 AND token = '<cls>' AND role IN ('pre_attn', 'final')
ORDER BY layer
"""

PREDICTIONS = """
-- Each held-out image, the digit the final site's class token reads as (the model's own
-- prediction: the ingest proved it equals the model's logits).
SELECT p.image, top_logits(vec, 1)[1].token AS predicted
FROM acts a JOIN prompts p USING (prompt_id)
WHERE site = 'final' AND token = '<cls>' ORDER BY prompt_id LIMIT 8
"""


def run(*args: str) -> None:
    print("$ actdb " + " ".join(shlex.quote(a) for a in args), flush=True)
    subprocess.run([str(ACTDB), *args], check=True)


def main() -> None:
    store = Path(sys.argv[1] if len(sys.argv) > 1 else "vision-demo.actdb")
    pictures = Path(sys.argv[2] if len(sys.argv) > 2 else "demo-pictures")
    from support.vision_models import train_digits

    work = Path(tempfile.mkdtemp(prefix="actdb-vision-demo-"))
    started = time.perf_counter()
    digits = train_digits(work, held_out=24)
    print(f"trained a ViT on scikit-learn's digits in {time.perf_counter() - started:.0f} s: "
          f"{digits.accuracy:.1%} held-out accuracy; model in {digits.model}", flush=True)
    print(f"true digits of the first held-out images: {digits.labels[:8]}")
    run("ingest", str(store), "--model", str(digits.model), "--images", str(digits.images))
    run("query", str(store), PREDICTIONS)
    run("query", str(store), LENS)
    pictures.mkdir(exist_ok=True)
    run("plot", "lens", str(store), "--prompt-id", "0", "-o", str(pictures / "vision-lens.png"))
    run("plot", "patches", str(store), "--input", "0", "-o",
        str(pictures / "vision-patches.png"))


if __name__ == "__main__":
    main()
