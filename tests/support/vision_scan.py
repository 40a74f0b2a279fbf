"""Every vision, video and multimodal model type `transformers` knows, built tiny from a config
and ingested.

    python tests/support/vision_scan.py [--timeout 60] [--markdown FILE] [model_type ...]

A survey of which families actdb ingests faithfully and which it refuses, in one sentence
(docs/FAMILIES.md holds its last output; tests/integration/test_vision_survey.py runs a
representative few). Each model type is built at the sizes of tests/support/vision_families.py
and run by its kind: an image classifier or a vision backbone on three 32 x 32 images, a video
classifier on two videos of four frames, a multimodal (image-text-to-text) model on two texts
alone (its text decoder; images with text are another part of the work). Its own forward pass
runs once first (a failure there is the survey config's or the environment's, not actdb's),
then the ingest, in two batches. After an ingest, each site's energy (the sum of its stored
norms squared) is compared with its module's inputs captured by plain forward hooks, an
independent check beside the one actdb makes of every site's output at ingest. Prints one line
a model type: OK with the sites, the worst output error actdb recorded, the worst energy
difference and the head (its logits proven at ingest), REFUSED with actdb's sentence, or the
stage that failed.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import logging
import os
import re
import signal
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for `support`

from support.vision_families import (  # noqa: E402
    BESIDE_TEXT,
    FRAMES,
    Family,
    build,
    families,
    random_images,
)

TEXTS = ["hello there world", "a longer prompt with more words in it"]


@dataclass(frozen=True)
class Outcome:
    family: Family
    status: str  # OK, REFUSED, NEEDS (a library not installed), FAIL, TIMEOUT
    stage: str  # build, forward, ingest, check
    detail: str  # OK: sites, errors and head; REFUSED: actdb's sentence; else the error

    def line(self) -> str:
        where = f" ({self.stage})" if self.status in ("FAIL", "TIMEOUT") else ""
        return (f"{self.status:<8} {self.family.model_type} [{self.family.kind}]{where}: "
                f"{self.detail}")


@functools.cache
def _tokenizer() -> Any:
    """The text tokenizer of the multimodal families (a small BPE, trained once)."""
    from support.tiny_models import build_family_tokenizer

    return build_family_tokenizer("llama")


class _Timeout(Exception):
    pass


def _alarm(*_: object) -> None:
    raise _Timeout


def _inputs(family: Family, size: int, work: Path) -> tuple[list[dict[str, Any]], Any, Any]:
    """(actdb inputs, processor, tokenizer) for the family's kind."""
    if family.kind == "multimodal":
        return [{"text": t} for t in TEXTS], None, _tokenizer()
    if family.kind == "video":
        from transformers import VideoMAEImageProcessor

        videos = []
        for v in range(2):
            folder = work / f"video{v}"
            folder.mkdir(parents=True, exist_ok=True)
            for i, im in enumerate(random_images(FRAMES, size=size, seed=v)):
                im.save(folder / f"{i:02d}.png")
            videos.append({"video": str(folder)})
        processor = VideoMAEImageProcessor(size={"height": size, "width": size},
                                           do_center_crop=False)
        return videos, processor, None
    from support.vision_families import image_processor

    return ([{"image": im} for im in random_images(3, size=size)],
            image_processor(size, family.model_type), None)


def _model_inputs(family: Family, inputs: list[dict[str, Any]], processor: Any,
                  tokenizer: Any, model: Any) -> list[dict[str, Any]]:
    """The model's own inputs, one input at a time (no padding in the reference); the pixels
    under the model's main input's name (`pixel_values_videos`, a Perceiver's `inputs`); an
    encoder-decoder's decoder reads its start token, as actdb's does without a target."""
    import torch

    from actdb.ingestion.seq2seq import is_encoder_decoder

    runs = _made(family, inputs, processor, tokenizer)
    main = model.main_input_name
    start = getattr(model.config, "decoder_start_token_id", None)
    for run in runs:
        if main not in run and "pixel_values" in run:
            run[main] = run.pop("pixel_values")
        if is_encoder_decoder(model) and isinstance(start, int):
            run["decoder_input_ids"] = torch.tensor([[start]])
    return runs


def _made(family: Family, inputs: list[dict[str, Any]], processor: Any,
          tokenizer: Any) -> list[dict[str, Any]]:
    if family.kind == "multimodal":
        return [dict(tokenizer([i["text"]], return_tensors="pt")) for i in inputs]
    if family.kind == "video":
        import numpy as np
        from PIL import Image

        out = []
        for i in inputs:
            frames = [np.asarray(Image.open(f).convert("RGB"))
                      for f in sorted(Path(i["video"]).iterdir())]
            made = processor(images=[frames], return_tensors="pt")
            out.append({k: v for k, v in made.items() if hasattr(v, "shape")})
        return out
    return [{k: v for k, v in processor(images=[i["image"]], return_tensors="pt").items()
             if hasattr(v, "shape")} for i in inputs]


def _energy_gap(model: Any, runs: list[dict[str, Any]], db: Any) -> float:
    """Worst relative difference, over sites, between the energy actdb stored (sum of norm^2)
    and that of the site modules' inputs captured with plain forward hooks."""
    import torch

    sites = db.sql("SELECT site, module FROM sites").fetchall()
    stored = dict(db.sql("SELECT site, sum(norm * norm) FROM acts GROUP BY site").fetchall())
    energy = {s: 0.0 for s, _ in sites}
    modules = dict(model.named_modules())
    seen: set[str] = set()

    def hook(site: str, path: str) -> Any:
        def keep(m: Any, args: tuple[Any, ...], out: Any) -> None:
            if path not in seen:  # the first call an input, as actdb stores
                seen.add(path)
                energy[site] += float(args[0].detach().double().pow(2).sum())

        return keep

    handles = []
    for site, module in sites:
        # a per-head site is a list of modules, one a head: their energies add up
        members = ([f"{module}.{i}" for i in range(len(modules[module]))]
                   if isinstance(modules[module], torch.nn.ModuleList) else [module])
        handles += [modules[p].register_forward_hook(hook(site, p)) for p in members]
    try:
        with torch.no_grad():
            for run in runs:
                seen.clear()
                model(**run)
    finally:
        for h in handles:
            h.remove()
    return max(abs(stored[s] - energy[s]) / max(energy[s], 1e-30) for s, _ in sites)


def scan(family: Family, work: Path) -> Outcome:
    """One family through build, forward, ingest and the energy check."""
    import torch

    import actdb
    from actdb.errors import ActdbError

    stage = "build"
    try:
        vocab = len(_tokenizer()) if family.kind == "multimodal" else None
        model, size = build(family, vocab_size=vocab)
        inputs, processor, tokenizer = _inputs(family, size, work / family.model_type)
        runs = _model_inputs(family, inputs, processor, tokenizer, model)
        stage = "forward"
        reads = set(inspect.signature(model.forward).parameters)
        try:
            with torch.no_grad():
                model(**runs[0])
        except Exception as e:
            # A model that reads text with its image (ShieldGemma 2, BLIP, IDEFICS), with its
            # sound (Voxtral Realtime's streamed features), with its words' boxes on a page
            # (UDOP's bbox) or with a required input of its own (PI0's robot state), an
            # image as tokens (ImageGPT's colour clusters), or no forward pass at all (an omni
            # model that generates through its parts): actdb is to refuse it in one sentence,
            # which the ingest below says; otherwise the failure is the survey config's.
            needs_image = re.search(r"pixel|image|patches|encoder_outputs|[Bb]box|"
                                    r"input_features|required positional argument|"
                                    r"_forward_unimplemented", str(e))
            needs_image = needs_image or family.model_type in BESIDE_TEXT
            if (family.kind == "multimodal" and not needs_image) or (
                    family.kind != "multimodal" and "input_ids" not in reads):
                raise
        stage = "ingest"
        store = work / f"{family.model_type}.actdb"
        kw: dict[str, Any] = ({"prompts": TEXTS, "tokenizer": tokenizer}
                              if family.kind == "multimodal"
                              else {"inputs": inputs, "processor": processor})
        summary = actdb.ingest(store, model=model, batch_size=2, device="cpu", **kw)
        stage = "check"
        db = actdb.connect(store)
        gap = _energy_gap(model, runs, db)
        head, logit_err = db.sql("SELECT head_kind, logit_max_rel_error FROM models"
                                 ).fetchall()[0]
        grids = db.sql("SELECT count(DISTINCT grid) FROM sites").fetchall()[0][0]
        worst = max(summary.max_rel_error.values())
        head_text = ("none" if head is None else
                     f"{head} (logits within {logit_err:.0e})" if logit_err is not None
                     else head)
        note = f"; {summary.warnings[0]}" if summary.warnings else ""
        if not gap <= 1e-3:
            return Outcome(family, "FAIL", stage, f"stored energy differs from the hooked "
                           f"inputs' by {gap:.2g}")
        return Outcome(family, "OK", stage,
                       f"{summary.sites} sites{f' on {grids} grids' if grids else ''}, output "
                       f"error {worst:.0e}, energy {gap:.0e}, head {head_text}{note}")
    except _Timeout:
        return Outcome(family, "TIMEOUT", stage, "")
    except ImportError as e:
        # transformers builds the family only with a library this environment lacks (timm,
        # natten): the family does not build tiny here, which is no finding about actdb
        needs = re.search(r"requires the (\w+) library", str(e))
        if stage != "build" or needs is None:
            raise
        return Outcome(family, "NEEDS", stage, f"the {needs.group(1)} library, not installed "
                       f"({type(e).__name__}: {str(e).strip().splitlines()[0][:120]})")
    except ActdbError as e:
        if stage != "ingest":
            raise
        return Outcome(family, "REFUSED", stage, str(e))
    except Exception as e:  # noqa: BLE001 - a survey reports every failure and goes on
        first = (str(e).strip().splitlines() or [""])[0][:200]
        return Outcome(family, "FAIL", stage, f"{type(e).__name__}: {first}")


def isolated(family: Family, work: Path, timeout: int) -> Outcome:
    """`scan` in a forked child, so that a family that crashes the process (a segfault, the
    kernel's out-of-memory killer) or hangs in native code is one line, not the survey's end;
    the child is killed past `timeout` seconds."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one family, its outcome as JSON on the pipe
        os.close(read)
        signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(timeout)
        try:
            outcome = scan(family, work)
        except _Timeout:
            outcome = Outcome(family, "TIMEOUT", "?", "")
        with os.fdopen(write, "w") as f:
            json.dump({"status": outcome.status, "stage": outcome.stage,
                       "detail": outcome.detail}, f)
        os._exit(0)
    os.close(write)
    deadline = time.monotonic() + timeout + 10
    status = 0
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(read)
        return Outcome(family, "TIMEOUT", "?", "killed")
    with os.fdopen(read) as f:
        text = f.read()
    if not text:
        return Outcome(family, "FAIL", "?", f"the process died ({_died(status)})")
    got = json.loads(text)
    return Outcome(family, got["status"], got["stage"], got["detail"])


def _died(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"signal {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit status {os.WEXITSTATUS(status)}"


def markdown(outcomes: list[Outcome]) -> str:
    """The survey as a Markdown table, a row a family."""
    rows = ["| family | kind | outcome | detail |", "|---|---|---|---|"]
    for o in outcomes:
        detail = o.detail.replace("|", "\\|")
        status = f"{o.status} ({o.stage})" if o.status in ("FAIL", "TIMEOUT") else o.status
        rows.append(f"| `{o.family.model_type}` | {o.family.kind} | {status} | {detail} |")
    return "\n".join(rows) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("types", nargs="*", help="model types (default: every vision, video and "
                    "multimodal type)")
    ap.add_argument("--kind", help="only this kind: image, backbone, video, multimodal")
    ap.add_argument("--timeout", type=int, default=60, help="seconds a model type")
    ap.add_argument("--markdown", help="also write the table to this file")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import transformers

    transformers.logging.set_verbosity_error()
    chosen = [f for f in families() if (not args.types or f.model_type in args.types)
              and (not args.kind or f.kind == args.kind)]
    import torch

    import actdb  # noqa: F401 - imported once, before the children are forked
    import actdb.ingestion.process  # noqa: F401 - the ingest's modules too

    torch.set_num_threads(1)  # tiny models, and the machine is shared
    work = Path(tempfile.mkdtemp(prefix="actdb-vision-scan-"))
    outcomes = []
    for family in chosen:
        outcome = isolated(family, work, args.timeout)
        outcomes.append(outcome)
        print(outcome.line(), flush=True)
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o.status] = counts.get(o.status, 0) + 1
    print(", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    if args.markdown:
        Path(args.markdown).write_text(markdown(outcomes))


if __name__ == "__main__":
    main()
