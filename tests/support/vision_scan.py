"""Every image-classification model type `transformers` knows, built tiny from a config and
ingested over two images.

    python tests/support/vision_scan.py [--timeout 60] [model_type ...]

Not part of the test suite: a survey of which vision families actdb ingests faithfully (every
site's output and the classifier's logits proven at ingest) and which it refuses, in one
sentence. Each model type gets common small sizes (the config ignores those it has no use
for), its own forward pass once (a failure there is the config's, not actdb's), then an
ingest of two 32 x 32 images through a plain image processor. Prints one line a model type:
OK with the head it got, REFUSED with actdb's sentence, or the stage that failed.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for `support`

# Sizes a tiny model of most families accepts; hierarchical ones read their own names.
SIZES = dict(image_size=32, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
             num_attention_heads=2, intermediate_size=64, embed_dim=16, depths=[1, 1],
             num_heads=[2, 2], hidden_sizes=[16, 32], num_labels=3, window_size=2,
             embed_dims=[16, 32], num_encoder_blocks=2, sr_ratios=[2, 1], mlp_ratios=[2, 2],
             num_stages=2, dims=[16, 32])


class _Timeout(Exception):
    pass


def _alarm(*_: object) -> None:
    raise _Timeout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("types", nargs="*", help="model types (default: all image classifiers)")
    ap.add_argument("--timeout", type=int, default=60, help="seconds a model type")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import numpy as np
    import torch
    from PIL import Image
    from transformers import AutoConfig, AutoModelForImageClassification, ViTImageProcessor
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES,
    )

    import actdb
    from actdb.errors import ActdbError

    processor = ViTImageProcessor(size={"height": 32, "width": 32})
    rng = np.random.default_rng(0)
    images = [{"image": Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8))}
              for _ in range(2)]
    types = args.types or sorted(MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES)
    signal.signal(signal.SIGALRM, _alarm)
    work = tempfile.mkdtemp(prefix="actdb-vision-scan-")
    counts: dict[str, int] = {}
    for mt in types:
        signal.alarm(args.timeout)
        stage = "build"
        try:
            config = AutoConfig.for_model(mt)
            for k, v in SIZES.items():
                if hasattr(config, k):
                    setattr(config, k, v)
            torch.manual_seed(0)
            model = AutoModelForImageClassification.from_config(config).eval()
            stage = "forward"
            with torch.no_grad():
                model(pixel_values=processor(images=[i["image"] for i in images],
                                             return_tensors="pt")["pixel_values"])
            stage = "ingest"
            summary = actdb.ingest(f"{work}/{mt}.actdb", model=model, processor=processor,
                                   inputs=images)
            db = actdb.connect(f"{work}/{mt}.actdb")
            head = db.sql("SELECT head_kind FROM models").fetchall()[0][0]
            worst = max(summary.max_rel_error.values())
            note = f" ({summary.warnings[0]})" if summary.warnings else ""
            line = (f"OK       {mt}: {summary.sites} sites, worst error {worst:.1e}, "
                    f"head {head}{note}")
            counts["ok"] = counts.get("ok", 0) + 1
        except _Timeout:
            line = f"TIMEOUT  {mt} ({stage})"
            counts["timeout"] = counts.get("timeout", 0) + 1
        except ActdbError as e:
            line = f"REFUSED  {mt}: {e}"
            counts["refused"] = counts.get("refused", 0) + 1
        except Exception as e:  # noqa: BLE001 - a survey reports every failure and goes on
            first = (str(e).strip().splitlines() or [""])[0][:200]
            line = f"FAIL     {mt} ({stage}): {type(e).__name__}: {first}"
            counts[stage] = counts.get(stage, 0) + 1
        finally:
            signal.alarm(0)
        print(line, flush=True)
    print(", ".join(f"{n} {k}" for k, n in sorted(counts.items())))


if __name__ == "__main__":
    main()
