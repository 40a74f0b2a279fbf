"""Every causal-LM model type `transformers` knows, built tiny from a config and ingested.

    python tests/support/family_scan.py [--from NAME] [--timeout 60] [model_type ...]

Not part of the test suite (about 20 minutes on two cores): a survey that finds the families
actdb cannot ingest. Each model type gets the real-families test's common sizes
(tests/support/real_families.py) and a tiny tokenizer, its own forward pass once (a failure there is
the config's, not actdb's), then an ingest of two prompts of different lengths in one padded
batch. Prints one line a model type: OK, or the stage that failed (build, forward, ingest)
with the error. The families of tests/slow/test_real_families.py are skipped (tested there).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for `support`


class _Timeout(Exception):
    pass


def _alarm(*_: object) -> None:
    raise _Timeout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("types", nargs="*", help="model types (default: all causal-LM types)")
    ap.add_argument("--from", dest="start", default="", help="skip types sorting before this")
    ap.add_argument("--timeout", type=int, default=60, help="seconds a model type")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    import actdb
    from support.real_families import COMMON, TESTED
    from support.tiny_models import build_family_tokenizer

    tok = build_family_tokenizer("llama")
    types = args.types or [t for t in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
                           if t not in TESTED and t >= args.start]
    signal.signal(signal.SIGALRM, _alarm)
    work = tempfile.mkdtemp(prefix="actdb-family-scan-")
    for mt in types:
        signal.alarm(args.timeout)
        stage = "build"
        try:
            config = AutoConfig.for_model(mt, **COMMON, vocab_size=len(tok))
            for k in ("pad_token_id", "bos_token_id", "eos_token_id"):
                try:
                    setattr(config, k, 0)
                except Exception:  # noqa: BLE001 - a config that refuses the id keeps its own
                    pass
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config).float().eval()
            stage = "forward"
            with torch.no_grad():
                model(**tok(["hello there world"], return_tensors="pt"))
            stage = "ingest"
            actdb.ingest(os.path.join(work, f"{mt}.actdb"), model=model, tokenizer=tok,
                         prompts=["hello there world", "a longer prompt with more words in it"],
                         batch_size=2, device="cpu", name="m")
            print(mt, "OK", flush=True)
        except _Timeout:
            print(mt, stage, "TIMEOUT", flush=True)
        except Exception as e:  # noqa: BLE001 - a survey: every failure is a line
            where = traceback.extract_tb(e.__traceback__)[-1]
            text = str(e).replace("\n", " ")[:200]
            print(mt, stage, "FAIL", type(e).__name__, text,
                  f"@{os.path.basename(where.filename)}:{where.lineno}", flush=True)
        finally:
            signal.alarm(0)


if __name__ == "__main__":
    main()
