"""The six workloads of the benchmark suite; each returns a Result with its ratios."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import torch
from generate import Shape, generate
from report import Result

import actdb
from actdb.store.store import Store

TOKEN = "w123"
# The device every workload runs on (run.py --device): the store's queries, the ingest and the
# torch baselines alike.
DEVICE = "cpu"


def alternating(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median wall time of each of `fns`, run in turn, round after round (after one warm-up
    round): on a machine whose load drifts from minute to minute, every function meets the
    same load, so their ratios hold where times taken one after the other do not."""
    return {k: statistics.median(v) for k, v in alternating_rounds(fns, repeats).items()}


def alternating_rounds(fns: dict[str, Callable[[], Any]], repeats: int
                       ) -> dict[str, list[float]]:
    """`alternating`'s wall times, every round's."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    return times


def timed(fn: Callable[[], Any], repeats: int, *, warmup: bool = True) -> float:
    """Median wall time of `fn` over `repeats` runs (after one warm-up run)."""
    if warmup:
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


# -- 1. ingest overhead ------------------------------------------------------------------------


def _gpt2_small(scale: Any) -> tuple[Any, Any, list[str]]:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(scale.vocab)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", pad_token="w0")
    torch.manual_seed(0)
    config = GPT2Config(n_embd=scale.d, n_layer=scale.layers, n_head=scale.heads,
                        vocab_size=scale.vocab, n_positions=1024, bos_token_id=0,
                        eos_token_id=0)
    model = GPT2LMHeadModel(config).eval()
    rng = np.random.default_rng(0)
    prompts = [" ".join(words[i] for i in rng.integers(0, scale.vocab, scale.prompt_tokens))
               for _ in range(scale.prompts)]
    return model, tokenizer, prompts


def ingest_overhead(scale: Any, work: Path, repeats: int) -> Result:
    model, tokenizer, prompts = _gpt2_small(scale)
    model = model.to(DEVICE)
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    batches = [{k: v[i : i + scale.batch_size].to(DEVICE) for k, v in enc.items()
                if k != "token_type_ids"} for i in range(0, len(prompts), scale.batch_size)]

    def full_model() -> None:
        with torch.no_grad():
            for b in batches:
                out = model(**b, output_hidden_states=True)
            _sync(out.logits)  # a GPU's last batch is inside the time, as the ingest's is

    runs = iter(range(1000))

    def ingest() -> None:
        actdb.ingest(work / f"ingest-{next(runs)}.actdb", model=model, tokenizer=tokenizer,
                     prompts=prompts, batch_size=scale.batch_size, device=DEVICE, name="gpt2")

    def backbone() -> None:
        with torch.no_grad():
            for b in batches:
                out = model.transformer(**b, use_cache=False)
            _sync(out.last_hidden_state)

    def ingest_one() -> None:
        actdb.ingest(work / f"ingest-{next(runs)}.actdb", model=model, tokenizer=tokenizer,
                     prompts=prompts[:1], batch_size=1, device=DEVICE, name="gpt2")

    def backbone_one() -> None:
        with torch.no_grad():
            out = model.transformer(**{k: v[:1] for k, v in batches[0].items()},
                                    use_cache=False)
            _sync(out.last_hidden_state)

    t_full = timed(full_model, repeats)
    # The ratio's two sides in alternating rounds, so that both meet the same load (on a
    # shared two-core machine the forward pass alone drifted by 20% between minutes). One
    # round's ratio moved between 1.1 and 1.5 there, and the median of three by 0.15 from run
    # to run: the median of at least five.
    rounds = max(repeats, 5)
    paired = alternating_rounds({"ingest": ingest, "backbone": backbone}, rounds)
    t_ingest, t_backbone = (statistics.median(paired[k]) for k in ("ingest", "backbone"))
    each = ", ".join(f"{i / b:.2f}" for i, b in zip(paired["ingest"], paired["backbone"],
                                                    strict=True))
    fixed = alternating({"ingest": ingest_one, "backbone": backbone_one}, rounds)
    t_fixed, t_backbone_one = fixed["ingest"], fixed["backbone"]
    n_tokens = int(enc["attention_mask"].sum())
    r = Result(
        title="1. Ingest overhead",
        what=(f"`actdb.ingest` of a GPT-2-small-shaped model (random weights, d={scale.d}, "
              f"{scale.layers} layers, vocabulary {scale.vocab}) over {scale.prompts} prompts x "
              f"{scale.prompt_tokens} tokens = {n_tokens} tokens, batch size "
              f"{scale.batch_size}, {DEVICE}, into a new store each run (weights and vocabulary "
              "written too). Baselines over the same batches: the forward pass the ingest "
              "itself runs (the model without its LM head, `model.transformer`, no cache), and "
              "the full model with `output_hidden_states=True`, as users run it. The ingest and "
              "the forward pass it runs are timed in alternating rounds (median of "
              f"{rounds}), so that both meet the same load."),
    )
    r.figure("forward pass the ingest runs (no LM head)",
             f"{t_backbone:.2f} s ({n_tokens / t_backbone:.0f} tokens/s)")
    r.figure("full model, output_hidden_states=True (bare forward)",
             f"{t_full:.2f} s ({n_tokens / t_full:.0f} tokens/s)")
    r.figure("actdb ingest", f"{t_ingest:.2f} s ({n_tokens / t_ingest:.0f} tokens/s)")
    r.figure("each round's ingest / forward pass", each)
    r.figure("an ingest of one prompt (fixed costs: new store, weights and vocabulary "
             "written, sites found)", f"{t_fixed:.2f} s")
    ratio = t_ingest / t_backbone
    r.ratio("ingest time / the forward pass it runs", ratio, "<= 1.3", ratio <= 1.3)
    r.ratio("ingest time / full model with hidden states", t_ingest / t_full, "(information)",
            True)
    # What each further token costs: both runs less their one-prompt runs (an ingest's fixed
    # work, the store created and the model registered, is in the one-prompt ingest).
    r.ratio("ingest / forward pass, beyond a one-prompt run of each",
            (t_ingest - t_fixed) / max(t_backbone - t_backbone_one, 1e-9), "(information)",
            True)
    if ratio > 1.3:
        r.notes.append(
            f"Where the time goes beyond the forward pass: about {t_fixed:.2f} s is fixed per "
            "ingest into a new store (the store created, the embedding and vocabulary written, "
            "sites found and the logit transform measured with small forward passes, the "
            "catalog folded at the end); beyond it, each further token costs "
            f"{(t_ingest - t_fixed) / max(t_backbone - t_backbone_one, 1e-9):.2f}x its forward "
            "pass: the hooks (direction, norm and mean of every norm input, and the output "
            "recomputed from them to prove faithfulness) and the chunk writes and commits, "
            "which run on other threads but share the machine's cores with the forward pass.")
    return r


# -- the scan data -------------------------------------------------------------------------


@dataclass
class ScanData:
    scale: Any
    store: Path
    n_vectors: int
    npy: Path
    baseline_db: Path
    anchor: np.ndarray  # float32 [d], unit: the TOKEN's anchor
    generate_seconds: float
    scan_bytes: int = 0  # the store's size on disk before workload 6 grows it

    @classmethod
    def build(cls, scale: Any, work: Path) -> ScanData:
        shape = Shape(d=scale.d, vocab=scale.vocab, n_sites=scale.scan_sites,
                      prompt_tokens=min(128, scale.scan_tokens // 16))
        store = work / "scan.actdb"
        t = time.perf_counter()
        generate(store, tokens=scale.scan_tokens, shape=shape)
        seconds = time.perf_counter() - t
        with Store(store) as st:
            embed = st.arrays.weight(0, "embed")
            sites = [s.site for s in st.catalog.sites("synthetic")]
        assert embed is not None
        a = embed[int(TOKEN[1:])]
        data = cls(scale=scale, store=store, n_vectors=scale.scan_tokens * len(sites),
                   npy=work / "vectors.npy", baseline_db=work / "baseline.duckdb",
                   anchor=(a / np.linalg.norm(a)).astype(np.float32), generate_seconds=seconds)
        data._write_baselines(sites)
        with Store(store) as st:
            data.scan_bytes = st.disk_bytes()["total"]
        # Every file just written (about 1.6 GB at medium scale) to disk before anything is
        # timed: the kernel writing them back during a timed read made the first workload's
        # scan 30% slower than the same scan a minute later (1.14x DuckDB against 1.41-1.49x).
        os.sync()
        return data

    def blocks(self, sites: list[str], rows: int = 65536) -> Any:
        """The stored vectors x = direction * norm (float32), block by block."""
        group = self._group()
        for s in sites:
            d16, norm = group[f"models/0/acts/{s}/direction"], group[f"models/0/acts/{s}/norm"]
            for lo in range(0, self.scale.scan_tokens, rows):
                hi = min(lo + rows, self.scale.scan_tokens)
                yield np.asarray(d16[lo:hi], np.float32) * np.asarray(norm[lo:hi])[:, None]

    def _group(self) -> Any:
        import zarr

        return zarr.open_group(str(self.store / "tensors.zarr"), mode="r")

    def sites(self) -> list[str]:
        return [k for k in self._group()["models/0/acts"].group_keys()]

    def _write_baselines(self, sites: list[str]) -> None:
        d = self.scale.d
        mm = np.lib.format.open_memmap(self.npy, mode="w+", dtype=np.float16,
                                       shape=(self.n_vectors, d))
        con = duckdb.connect(str(self.baseline_db))
        con.execute(f"CREATE TABLE vecs (v FLOAT[{d}])")
        at = 0
        for x in self.blocks(sites):
            mm[at : at + len(x)] = x.astype(np.float16)
            at += len(x)
            arr = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), d)
            batch = pa.table({"v": arr})
            con.register("batch", batch)
            con.execute("INSERT INTO vecs SELECT v FROM batch")
            con.unregister("batch")
        mm.flush()
        del mm
        con.close()


# -- 2. full scan --------------------------------------------------------------------------


class ActdbScan:
    """The query on one open connection; every run starts with no chunk cached (the page
    cache stays warm, as it does for the baselines), and counts what it reads."""

    def __init__(self, store: Path, where: str = "", params: dict[str, Any] | None = None):
        self.db = actdb.connect(store, device=DEVICE)
        self.query = f"SELECT avg(cosine_to_anchor(vec, '{TOKEN}')) FROM acts {where}"
        self.params = params
        self.stats: dict[str, int] = {}

    def __call__(self) -> Any:
        self.db.drop_caches()
        before = self.db.stats
        out = self.db.sql(self.query, params=self.params).fetchall()[0][0]
        self.stats = {k: v - before[k] for k, v in self.db.stats.items()}
        return out

    def close(self) -> None:
        self.db.close()


def full_scan(scan: ScanData, repeats: int) -> Result:
    n, d = scan.n_vectors, scan.scale.d
    ours = ActdbScan(scan.store)
    con = duckdb.connect(str(scan.baseline_db), read_only=True)
    anchor_list = scan.anchor.tolist()

    def duck() -> float:
        return con.execute(f"SELECT avg(array_cosine_similarity(v, $a::FLOAT[{d}])) FROM vecs",
                           {"a": anchor_list}).fetchall()[0][0]

    def numpy_mm() -> float:
        mm = np.load(scan.npy, mmap_mode="r")
        total = 0.0
        for lo in range(0, len(mm), 65536):
            x = np.asarray(mm[lo : lo + 65536], dtype=np.float32)
            total += float((x @ scan.anchor / np.linalg.norm(x, axis=1)).sum())
        return total / len(mm)

    sites = scan.sites()
    group = scan._group()

    def zarr_read() -> None:
        for s in sites:
            arr = group[f"models/0/acts/{s}/direction"]
            for lo in range(0, scan.scale.scan_tokens, 65536):
                np.asarray(arr[lo : lo + 65536])

    # chunk keys with the separator "." (a local store's vectors since 2026-11-27) or "/"
    acts = scan.store / "tensors.zarr" / "models" / "0" / "acts"
    chunk_files = sorted([*acts.glob("*/direction/c.*"), *acts.glob("*/direction/c/*/0")])
    n_chunks = sum(-(-group[f"models/0/acts/{s}/direction"].shape[0]
                     // group[f"models/0/acts/{s}/direction"].chunks[0]) for s in sites)
    if len(chunk_files) != n_chunks:  # a floor that reads less than the scan is no floor
        raise RuntimeError(f"found {len(chunk_files)} direction chunk files, not {n_chunks}")

    def raw_read() -> None:
        for f in chunk_files:
            np.fromfile(f, dtype=np.float16)

    values = {"actdb": ours(), "duckdb": duck(), "numpy": numpy_mm()}
    spread = max(values.values()) - min(values.values())
    # each a second or less: taken in turn, round after round, so that a drifting load
    # meets them all alike (at least 7 rounds whatever the scale's repeats)
    times = alternating({"actdb": ours, "duckdb": duck, "numpy": numpy_mm, "raw": raw_read},
                        max(repeats, 7))
    times["zarr"] = timed(zarr_read, repeats)
    con.close()
    rate = {k: n / t for k, t in times.items()}
    r = Result(
        title="2. Full scan",
        what=(f"`SELECT avg(cosine_to_anchor(vec, '{TOKEN}')) FROM acts` over {n:,} stored "
              f"vectors of width {d} ({scan.scale.scan_sites} sites x "
              f"{scan.scale.scan_tokens:,} tokens; synthetic store written through the store's "
              f"own API in {scan.generate_seconds:.0f} s). Baselines on the same vectors: "
              f"(a) DuckDB `array_cosine_similarity` over a `FLOAT[{d}]` table; (b) NumPy over a "
              "float16 `.npy` memory map, 65,536 rows a block; (c) reading the same Zarr "
              "direction bytes with no computation, through zarr-python and as raw chunk files "
              "(the I/O floor is the faster of the two). actdb, (a), (b) and the raw read are "
              f"timed in turn, round after round: medians of {max(repeats, 7)} rounds."),
    )
    for k, label in (("actdb", "actdb"), ("duckdb", "(a) DuckDB array_cosine_similarity"),
                     ("numpy", "(b) NumPy float16 memmap"), ("zarr", "(c) zarr-python read"),
                     ("raw", "(c) raw chunk-file read")):
        r.figure(label, f"{times[k]:.2f} s, {rate[k] / 1e6:.2f} M rows/s")
    r.figure("mean cosine (actdb, DuckDB, NumPy)",
             ", ".join(f"{v:.6f}" for v in values.values()) + f" (spread {spread:.1e})")
    floor = max(rate["zarr"], rate["raw"])
    r.ratio("actdb / DuckDB rows/s", rate["actdb"] / rate["duckdb"], ">= 1.5",
            rate["actdb"] >= 1.5 * rate["duckdb"])
    r.ratio("actdb / NumPy rows/s", rate["actdb"] / rate["numpy"], ">= 1.5",
            rate["actdb"] >= 1.5 * rate["numpy"])
    r.ratio("actdb / I/O floor rows/s", rate["actdb"] / floor, ">= 0.5",
            rate["actdb"] >= 0.5 * floor)
    r.figure("_seconds", str(times["actdb"]))
    if rate["actdb"] < 1.5 * rate["duckdb"] or rate["actdb"] < 0.5 * floor:
        r.notes += _scan_profile(ours, times, rate, floor)
    ours.close()
    return r


def _scan_profile(ours: ActdbScan, times: dict[str, float], rate: dict[str, float],
                  floor: float) -> list[str]:
    """Where a full scan's time goes, from one run under cProfile (shares of its total)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    ours()
    prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]

    def cum(pred: Callable[[str, str], bool], tot: bool = False) -> float:
        return sum((st[2] if tot else st[3]) for (f, _, name), st in stats.items()
                   if pred(f, name))

    total = cum(lambda f, n: n == "submit" and "duckdb" in f)
    # Runs read and multiplied on the query's thread (runs.RunWalk.dots), chunk reads
    # (ChunkCache.get), and waits for the read-ahead thread's runs (Future.result)
    runs = cum(lambda f, n: f.endswith("runs.py") and n == "dots")
    reads = runs + cum(lambda f, n: f.endswith("chunk_cache.py") and n == "get") + cum(
        lambda f, n: f.endswith("_base.py") and n == "result")

    def kernel(n: str) -> bool:  # the compiled kernel, or torch's conversion and product
        return "f16_dots" in n or "copy_" in n or "mul_" in n or "built-in method sum" in n

    # the products made outside a run's task (those inside are counted with the runs)
    compute = sum(tt for (f, _, n), st in stats.items() if kernel(n)
                  for (_, _, caller), (_, _, tt, _) in st[4].items() if caller != "dots")
    in_runs = sum(tt for (f, _, n), st in stats.items() if kernel(n)
                  for (_, _, caller), (_, _, tt, _) in st[4].items() if caller == "dots")
    udf = cum(lambda f, n: f.endswith("execute.py") and n == "udf")
    calls = sum(st[1] for (f, _, n), st in stats.items() if f.endswith("execute.py") and n == "udf")
    glue = max(udf - reads - compute, 0.0)
    outside = max(total - udf, 0.0)
    budget = 1.0 / (1.5 * rate["duckdb"]) * (times["actdb"] * rate["actdb"])
    return [
        f"Targets missed in this run. Where the time goes (one scan under cProfile, "
        f"{total:.2f} s with profiling): reading chunk files and their products on the "
        f"query's thread, or waiting for the read-ahead thread's, {reads / total:.0%} (of "
        f"which the products {in_runs / total:.0%}), float16 conversion and dot products "
        f"elsewhere {compute / total:.0%}, per-batch Python work in the UDF (argument "
        f"decoding, grouping, chunk bookkeeping) {glue / total:.0%}, DuckDB itself (the "
        f"join that makes `acts`, calling {calls} UDF batches of at most 2,048 rows, the "
        f"aggregate) {outside / total:.0%}.",
        f"The DuckDB target means the whole query in {budget:.2f} s; reading the "
        f"direction bytes alone from the page cache takes {times['raw']:.2f} s here.",
    ]


# -- 3. selective query ----------------------------------------------------------------------


def selective(scan: ScanData, repeats: int, full: Result) -> Result:
    with Store(scan.store) as st:
        n_prompts = int((st.catalog.one("SELECT count(*) FROM prompts") or (0,))[0])
    rng = np.random.default_rng(1)
    ids = sorted(rng.choice(n_prompts, max(1, n_prompts // 100), replace=False).tolist())
    run = ActdbScan(scan.store, "WHERE prompt_id IN (SELECT unnest($ids))", {"ids": ids})
    t = timed(run, repeats)
    stats = run.stats
    run.close()
    d = scan.scale.d
    total = scan.n_vectors * (2 * d + 8)
    full_seconds = float(dict(full.figures)["_seconds"])
    full.figures = [f for f in full.figures if f[0] != "_seconds"]
    r = Result(
        title="3. Selective query",
        what=(f"The same function over {len(ids)} of {n_prompts} prompts (1%, chosen at random "
              "with a fixed seed): `... FROM acts WHERE prompt_id IN (SELECT unnest($ids))`. "
              "Bytes read are counted by the query layer's chunk reader (direction, norm and "
              "mean chunks), against all bytes of those arrays."),
    )
    r.figure("time", f"{t * 1000:.0f} ms (full scan {full_seconds * 1000:.0f} ms)")
    r.figure("bytes read", f"{stats['bytes_read']:,} of {total:,} "
                           f"({stats['chunks_read']} chunks)")
    r.ratio("bytes read / array bytes", stats["bytes_read"] / total, "<= 0.03",
            stats["bytes_read"] <= 0.03 * total)
    r.ratio("time / full-scan time", t / full_seconds, "<= 0.05", t <= 0.05 * full_seconds)
    return r


# -- 4. nearest anchors ----------------------------------------------------------------------


def nearest(scan: ScanData, repeats: int) -> Result:
    from actdb.query.topk import lowp_dtype

    d, v = scan.scale.d, scan.scale.vocab
    rows = scan.scale.nearest_rows
    prompt_tokens = min(128, scan.scale.scan_tokens // 16)
    n_prompts = rows // prompt_tokens
    site = scan.sites()[0]
    query = (f"SELECT nearest_anchors(vec, 10) AS n FROM acts WHERE prompt_id < {n_prompts} "
             f"AND site = '{site}' ORDER BY prompt_id, position")

    db = actdb.connect(scan.store, device=DEVICE)
    got: list[Any] = []

    def ours() -> None:
        db.drop_caches()
        got[:] = [r[0] for r in db.sql(query).fetchall()]
        assert len(got) == rows

    dev = torch.device(DEVICE)
    t_ours = timed(ours, repeats)
    # The exact answer for the same vectors, computed here in float64 with torch alone. A row
    # may differ from it only where float32 cannot tell two tokens apart: tokens swapped
    # whose float64 cosines differ by less than twice float32's bound on a dot product's
    # error (d * 2^-24 for unit vectors).
    x = db.vectors(f"SELECT vec FROM acts WHERE prompt_id < {n_prompts} AND site = '{site}' "
                   "ORDER BY prompt_id, position").double()
    anchors = db.source.weights.anchors(db.source.models[0], None).double()
    u = x / torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    tie = 2 * d * 2.0**-24
    same = ties = 0
    for lo in range(0, rows, 512):
        scores = u[lo : lo + 512] @ anchors.T
        want = torch.topk(scores, 10, dim=-1)
        for j, (w_ids, w_vals) in enumerate(zip(want.indices.tolist(), want.values.tolist(),
                                                strict=True)):
            ids = [e["token_id"] for e in got[lo + j]]
            if ids == w_ids:
                same += 1
            elif all(abs(float(scores[j, t]) - v) <= tie for t, v in zip(ids, w_vals,
                                                                        strict=True)):
                ties += 1
    lowp = lowp_dtype(dev)
    db.close()
    g = torch.Generator().manual_seed(0)
    # The matmul baselines over a slice of the rows (the rate is the shape's, the time shorter).
    part = min(rows, 1024)
    a = torch.randn(part, d, generator=g).to(dev)
    w = torch.randn(d, v, generator=g).to(dev)
    ab, wb = a.bfloat16(), w.bfloat16()
    t_fp32 = timed(lambda: _sync(a @ w), repeats) * rows / part
    t_bf16 = timed(lambda: _sync(ab @ wb), repeats) * rows / part
    flops = 2.0 * rows * d * v
    best = min(t_fp32, t_bf16)
    r = Result(
        title="4. Nearest anchors",
        what=(f"`{query}`: {rows:,} vectors against all {v:,} anchors (k = 10). Baselines: "
              f"same-shaped torch matrix products [{rows}, {d}] @ [{d}, {v}] in bfloat16 and "
              f"float32 on the same device (timed over {part} rows, scaled). The engine's "
              f"candidate dtype here: {lowp or 'float32 (no fast bfloat16 on this device)'}."),
    )
    r.figure("actdb", f"{t_ours:.3f} s, {flops / t_ours / 1e9:.1f} GFLOP/s")
    r.figure("torch matmul bfloat16", f"{t_bf16:.3f} s, {flops / t_bf16 / 1e9:.1f} GFLOP/s")
    r.figure("torch matmul float32", f"{t_fp32:.3f} s, {flops / t_fp32 / 1e9:.1f} GFLOP/s")
    r.figure("rows whose top-10 equals the exact (float64) top-10", f"{same} of {rows}")
    r.figure("rows that differ from it only by a float32 tie (tokens swapped whose exact "
             "cosines differ by less than float32 can resolve)", f"{ties} of {rows}")
    r.ratio("actdb FLOP rate / bf16 matmul FLOP rate", t_bf16 / t_ours, ">= 0.5",
            t_bf16 / t_ours >= 0.5)
    r.ratio("actdb FLOP rate / fastest matmul FLOP rate", best / t_ours, "(information)", True)
    r.ratio("rows with the float32 top-k", (same + ties) / rows, "1 (ties aside)",
            same + ties == rows)
    if t_bf16 > t_fp32:
        r.notes.append("This CPU has no AVX-512 BF16 or AMX instructions: its bfloat16 matrix "
                       "product is slower than float32, so the engine ranks in float32 here "
                       "(query/topk.py) and the fair baseline is the faster of the two.")
    return r


def _sync(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cuda":
        torch.cuda.synchronize()
    return t


# -- 5. storage and 6. memory ----------------------------------------------------------------


def storage(scan: ScanData) -> Result:
    d = scan.scale.d
    with Store(scan.store) as st:
        sizes = st.disk_bytes()
        n = int((st.catalog.one("SELECT n_rows FROM models") or (0,))[0]) * scan.scale.scan_sites
    per = sizes["total"] / n
    weights = scan.scale.vocab * d * 4
    r = Result(
        title="5. Storage",
        what=("Bytes on disk per stored (token, site) vector, every file of the store counted "
              f"(catalog, tensors, tokenizers), for the store of workload 6 ({n:,} vectors)."),
    )
    r.figure("store", f"{sizes['total']:,} bytes: catalog {sizes['catalog']:,}, tensors "
                      f"{sizes['tensors']:,} (of which the {weights:,}-byte float32 embedding)")
    r.figure("per vector", f"{per:.1f} bytes; 2d + 16 = {2 * d + 16}")
    grown = n - scan.n_vectors
    r.figure("per vector without the per-model weights",
             f"{(sizes['total'] - weights) / n:.1f} bytes")
    r.ratio("bytes per vector / (2d + 16)", per / (2 * d + 16), "<= 1", per <= 2 * d + 16)
    if grown > 0:  # the memory workload grew the store (not at every scale)
        marginal = (sizes["total"] - scan.scan_bytes) / grown
        r.figure("marginal bytes per vector", f"{marginal:.1f} (growing the store from "
                 f"{scan.n_vectors:,} to {n:,} vectors); the vectors themselves take 2d + 8 "
                 f"= {2 * d + 8}")
        r.ratio("marginal bytes per vector / (2d + 16)", marginal / (2 * d + 16), "<= 1",
                marginal <= 2 * d + 16)
    fixed = sizes["total"] - (2 * d + 8) * n
    if per > 2 * d + 16:
        r.notes.append(
            f"Each vector takes 2d + 8 bytes (float16 direction, float32 norm and mean); the "
            f"rest, {fixed:,} bytes here, is per model and per token: the {weights:,}-byte "
            f"float32 embedding matrix (the anchors and the LM head, kept exact so that "
            f"`logit` reproduces the model's logits) and the catalog. The target leaves 8 "
            f"bytes a vector for all of it, so it is met from about "
            f"{fixed / 8 / 1e6:.0f} M vectors on (a GPT-2-small ingest of 25 sites reaches "
            f"that at about {fixed / 8 / 25 / 1e6:.1f} M tokens); below that the per-model "
            "weights dominate. Storing them as float16 would halve them at the cost of "
            "exact logits.")
    return r


_MEMORY_SCRIPT = """
import json, sys, time
import actdb
t = time.perf_counter()
with actdb.connect(sys.argv[1], device="cpu") as db:
    value = db.sql("SELECT avg(cosine_to_anchor(vec, 'w123')) FROM acts").fetchall()[0][0]
# VmHWM, not ru_maxrss: Linux carries a parent's ru_maxrss across fork and exec.
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM"))
print(json.dumps({"seconds": time.perf_counter() - t, "value": value, "max_rss_kb": hwm}))
"""


def memory(scan: ScanData) -> Result:
    shape = Shape(d=scan.scale.d, vocab=scan.scale.vocab, n_sites=scan.scale.scan_sites,
                  prompt_tokens=min(128, scan.scale.scan_tokens // 16))
    generate(scan.store, tokens=scan.scale.big_tokens, shape=shape)
    with Store(scan.store) as st:
        size = st.disk_bytes()["total"]
    n = scan.scale.big_tokens * scan.scale.scan_sites
    out = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, str(scan.store)],
                         capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError("the memory workload's scan failed: "
                           + " | ".join(out.stderr.strip().splitlines()[-4:]))
    got = json.loads(out.stdout.strip().splitlines()[-1])
    rss = got["max_rss_kb"] * 1024
    r = Result(
        title="6. Memory",
        what=(f"Peak resident memory of a full scan (workload 2's query) in a fresh process, "
              f"over the same store grown to {n:,} vectors, {size / 1e9:.2f} GB on disk."),
    )
    r.figure("peak RSS", f"{rss / 2**30:.2f} GiB")
    r.figure("scan", f"{got['seconds']:.1f} s, {n / got['seconds'] / 1e6:.2f} M rows/s")
    r.ratio("peak RSS / 1.5 GB", rss / 1.5e9, "<= 1", rss <= 1.5e9)
    if size < 4e9:
        r.notes.append(f"At this scale the store is {size / 1e9:.2f} GB, under the 4 GB the "
                       "target names: run `--scale full` for the real figure.")
    return r


# -- 7. checksum cost ------------------------------------------------------------------------


def checksum_cost(scan: ScanData, repeats: int) -> Result:
    """Workload 2's query with every chunk's CRC-32C checked (as always for users) and, in
    runs alternating with those, not checked: what integrity costs a full scan."""
    from actdb.store.arrays import crc32c

    ours = ActdbScan(scan.store)
    arrays = ours.db.store.arrays

    def scan_with(check: bool) -> float:
        arrays.check_checksums = check
        t = time.perf_counter()
        ours()
        return time.perf_counter() - t

    scan_with(True)
    scan_with(False)
    checked, unchecked = [], []
    for _ in range(max(repeats, 7)):  # alternate, so that load changes hit both alike
        checked.append(scan_with(True))
        unchecked.append(scan_with(False))
    arrays.check_checksums = True
    t_on, t_off = statistics.median(checked), statistics.median(unchecked)
    read = ours.stats.get("bytes_read", 0)
    ours.close()
    block = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8)
    t = time.perf_counter()
    crc32c(block)
    crc_rate = block.nbytes / (time.perf_counter() - t)
    r = Result(
        title="7. Checksum cost",
        what=(f"Workload 2's query over the same {scan.n_vectors:,} vectors "
              f"({read / 1e6:,.0f} MB of chunks read a scan), with the CRC-32C of every chunk "
              "checked as it is read (always, for users) and unchecked "
              "(`Arrays.check_checksums = False`, a benchmark-only switch), in alternating "
              f"runs; medians of {len(checked)} each."),
    )
    r.figure("checked", f"{t_on:.3f} s (fastest {min(checked):.3f} s)")
    r.figure("unchecked", f"{t_off:.3f} s (fastest {min(unchecked):.3f} s)")
    r.figure("CRC-32C alone (the crc32c package, one 64 MiB buffer)", f"{crc_rate / 1e9:.1f} GB/s")
    r.ratio("checked time / unchecked time", t_on / t_off, "<= 1.05", t_on <= 1.05 * t_off)
    return r


# -- 8. contention ---------------------------------------------------------------------------

_SPIN = "import time\nend = time.time() + 600\nwhile time.time() < end:\n    pass\n"


def contention(scan: ScanData, repeats: int) -> Result:
    """Workload 2's scan, quiet and while two CPU-bound processes run; NumPy likewise."""
    ours = ActdbScan(scan.store)

    def numpy_mm() -> float:
        mm = np.load(scan.npy, mmap_mode="r")
        total = 0.0
        for lo in range(0, len(mm), 65536):
            x = np.asarray(mm[lo : lo + 65536], dtype=np.float32)
            total += float((x @ scan.anchor / np.linalg.norm(x, axis=1)).sum())
        return total

    quiet = {"actdb": timed(ours, repeats), "numpy": timed(numpy_mm, repeats)}
    spinners = [subprocess.Popen([sys.executable, "-c", _SPIN]) for _ in range(2)]
    try:
        time.sleep(0.5)  # both spinning before the clock starts
        busy = {"actdb": timed(ours, repeats), "numpy": timed(numpy_mm, repeats)}
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    ours.close()
    r = Result(
        title="8. Full scan under contention",
        what=(f"Workload 2's query over {scan.n_vectors:,} vectors, quiet and while two "
              "CPU-bound Python processes (busy loops) run beside it; the NumPy float16 memmap "
              "baseline of workload 2 measured the same way for comparison."),
    )
    for k in ("actdb", "numpy"):
        r.figure(k, f"quiet {quiet[k]:.2f} s, contended {busy[k]:.2f} s "
                    f"({busy[k] / quiet[k]:.2f}x)")
    ratio = busy["actdb"] / quiet["actdb"]
    r.ratio("actdb contended / quiet time", ratio, "<= 2.5", ratio <= 2.5)
    r.ratio("NumPy contended / quiet time", busy["numpy"] / quiet["numpy"], "(information)",
            True)
    return r


# -- 12. other functions over a full scan -----------------------------------------------------

# (label, SQL expression): functions that need the whole float32 vector (its unit, a view)
FUNCTION_SCANS = (
    ("dim_contribution", "dim_contribution(vec, 5)"),
    ("anchor_contribution", f"anchor_contribution(vec, 5, '{TOKEN}')"),
    ("rotation_angle", "rotation_angle(vec)"),
    ("dim_contribution of a view", "dim_contribution(normed(vec), 5)"),
    ("cosine_to_anchor of a view", f"cosine_to_anchor(normed(vec), '{TOKEN}')"),
    # a FLOAT[] direction (a literal here; a parameter or a subquery alike), {d} its width
    ("cosine_to", "cosine_to(vec, [cos(i) FOR i IN range({d})])"),
    ("project", "project(vec, [cos(i) FOR i IN range({d})])"),
    ("cosine_to of a view", "cosine_to(normed(vec), [cos(i) FOR i IN range({d})])"),
)


def function_scans(scan: ScanData, repeats: int) -> Result:
    """Workload 2's scan with functions that need each whole vector in float32, and the
    NumPy float16 memmap baseline of `dim_contribution` (unit(x)[:, 5])."""
    db = actdb.connect(scan.store, device=DEVICE)
    times, values = {}, {}
    scans = [(label, expr.replace("{d}", str(scan.scale.d))) for label, expr in FUNCTION_SCANS]
    for label, expr in scans:
        query = f"SELECT avg({expr}) FROM acts"

        def run(query: str = query) -> float:
            db.drop_caches()
            return db.sql(query).fetchall()[0][0]

        values[label] = run()
        times[label] = timed(run, repeats, warmup=False)
    db.close()

    def numpy_dim() -> float:
        mm = np.load(scan.npy, mmap_mode="r")
        total = 0.0
        for lo in range(0, len(mm), 65536):
            x = np.asarray(mm[lo : lo + 65536], dtype=np.float32)
            total += float((x[:, 5] / np.linalg.norm(x, axis=1)).sum())
        return total / len(mm)

    reference = numpy_dim()
    t_numpy = timed(numpy_dim, repeats)
    r = Result(
        title="12. Other functions over a full scan",
        what=(f"`SELECT avg(f) FROM acts` over the {scan.n_vectors:,} vectors of workload 2 for "
              "functions that need each whole vector in float32 (its unit, or a view: "
              "`normed` is the site's output); each vector is converted from float16, scaled "
              "by its norm and transformed block by block in the core's cache "
              "(`Group.x_blocks`). Also the functions of a FLOAT[] direction: over raw vectors "
              "their products are the stored directions' with the direction's unit, as "
              "`cosine_to_anchor`'s (workload 2), over a view they take the path above. "
              "Baseline: NumPy over the float16 `.npy` memory map of "
              "workload 2, 65,536 rows a block, for `dim_contribution`."),
    )
    for label, expr in scans:
        r.figure(f"`{expr}`", f"{times[label]:.2f} s, {scan.n_vectors / times[label] / 1e6:.2f} "
                              f"M rows/s (mean {values[label]:.6g})")
    r.figure("NumPy unit(x)[:, 5]", f"{t_numpy:.2f} s, {scan.n_vectors / t_numpy / 1e6:.2f} "
                                    f"M rows/s (mean {reference:.6g})")
    ours = values["dim_contribution"]
    r.figure("mean dim_contribution (actdb, NumPy)",
             f"{ours:.6f}, {reference:.6f} (spread {abs(ours - reference):.1e})")
    ratio = t_numpy / times["dim_contribution"]
    r.ratio("dim_contribution actdb / NumPy rows/s", ratio, ">= 1.5", ratio >= 1.5)
    return r


# -- 13. vector aggregates ------------------------------------------------------------------


def aggregates(scan: ScanData, repeats: int) -> Result:
    """`mean_vector` per site and `spectrum` per prompt and of one whole site, against NumPy
    over the same stored vectors (read from the Zarr arrays directly), float64."""
    db = actdb.connect(scan.store, device=DEVICE)
    site = scan.sites()[0]
    runs = db.sql("SELECT prompt_id, row_start, n_tokens FROM prompt_runs ORDER BY prompt_id"
                  ).fetchall()
    n_prompts = min(len(runs), 256)
    queries = {
        "mean": "SELECT site, mean_vector(list(vec)) FROM acts GROUP BY site ORDER BY site",
        "prompts": (f"SELECT prompt_id, spectrum(list(vec), 5) FROM acts WHERE site = '{site}' "
                    f"AND prompt_id < {n_prompts} GROUP BY prompt_id ORDER BY prompt_id"),
        "site": f"SELECT spectrum(list(vec), 5) FROM acts WHERE site = '{site}'",
    }
    times, answers = {}, {}
    for key, query in queries.items():
        def run(query: str = query) -> list[Any]:
            db.drop_caches()
            return db.sql(query).fetchall()

        answers[key] = run()
        times[key] = timed(run, repeats, warmup=False)
    db.close()

    group = scan._group()

    def x_of(name: str, lo: int = 0, hi: int | None = None) -> np.ndarray:
        hi = scan.scale.scan_tokens if hi is None else hi
        d16 = group[f"models/0/acts/{name}/direction"]
        norm = group[f"models/0/acts/{name}/norm"]
        return np.asarray(d16[lo:hi], np.float32) * np.asarray(norm[lo:hi])[:, None]

    def numpy_means() -> list[np.ndarray]:
        return [np.mean(x_of(name), axis=0, dtype=np.float64) for name in sorted(scan.sites())]

    def eig5(x: np.ndarray) -> np.ndarray:
        return np.linalg.eigvalsh(np.cov(x.astype(np.float64).T))[::-1][:5]

    def numpy_prompts() -> list[np.ndarray]:
        return [eig5(x_of(site, lo, lo + n)) for _, lo, n in runs[:n_prompts]]

    def numpy_site() -> np.ndarray:
        return eig5(x_of(site))

    want = {"mean": numpy_means(), "prompts": numpy_prompts(), "site": numpy_site()}
    t_numpy = {"mean": timed(numpy_means, repeats), "prompts": timed(numpy_prompts, repeats),
               "site": timed(numpy_site, 1, warmup=False)}
    spread = {
        "mean": max(float(np.max(np.abs(np.asarray(got, np.float64) - w) / np.abs(w).max()))
                    for (_, got), w in zip(answers["mean"], want["mean"], strict=True)),
        "prompts": max(float(np.max(np.abs(np.asarray(got, np.float64) - w) / w[0]))
                       for (_, got), w in zip(answers["prompts"], want["prompts"], strict=True)),
        "site": float(np.max(np.abs(np.asarray(answers["site"][0][0], np.float64)
                                    - want["site"]) / want["site"][0])),
    }
    r = Result(
        title="13. Vector aggregates",
        what=(f"`mean_vector(list(vec))` of each of {len(want['mean'])} sites "
              f"({scan.scale.scan_tokens:,} vectors each), `spectrum(list(vec), 5)` of each of "
              f"{n_prompts} prompts (fewer vectors than dimensions: an [n, n] eigenproblem) and "
              f"of one whole site (a [d, d] one, d = {scan.scale.d}), against NumPy float64 over "
              "the same stored vectors read from the Zarr arrays; spreads relative to the "
              "largest value"),
    )
    labels = {"mean": "mean_vector per site", "prompts": "spectrum per prompt",
              "site": "spectrum of a site"}
    for key, label in labels.items():
        r.figure(f"{label} (actdb, NumPy)", f"{times[key]:.2f} s, {t_numpy[key]:.2f} s "
                                            f"(spread {spread[key]:.1e})")
    for key, label in labels.items():
        ratio = t_numpy[key] / times[key]
        r.ratio(f"{label}: actdb / NumPy speed", ratio, "(information)", True)
    return r


# -- 9. start-up -----------------------------------------------------------------------------

_START = """
import resource, subprocess, sys
subprocess.run([sys.executable, *sys.argv[1:]], check=True, capture_output=True)
u = resource.getrusage(resource.RUSAGE_CHILDREN)
print(u.ru_utime + u.ru_stime)
"""
# A query that calls a function: sqlglot then reads it too (query/plan.py).
_COUNT = "SELECT count(*) FROM prompts"


def start_up(scan: ScanData, repeats: int) -> Result:
    """CPU time of `actdb query STORE "SELECT 1"`, a fresh process each time."""
    # As installed: the first run writes the package's bytecode, later runs load it (a
    # PYTHONDONTWRITEBYTECODE=1 environment would recompile ~40 modules every run, 0.09 s).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    commands = {
        "select 1": ["-m", "actdb", "query", str(scan.store), "SELECT 1"],
        "count": ["-m", "actdb", "query", str(scan.store), _COUNT],
        "imports": ["-c", "import numpy, duckdb, pyarrow, click"],
        "python": ["-c", "pass"],
    }

    def one(args: list[str]) -> float:
        out = subprocess.run([sys.executable, "-c", _START, *args],
                             capture_output=True, text=True, check=True, env=env)
        return float(out.stdout.strip())

    times: dict[str, list[float]] = {k: [] for k in commands}
    for args in commands.values():
        one(args)
    for _ in range(max(repeats, 5)):  # alternating, so a slower minute hits them all
        for key, args in commands.items():
            times[key].append(one(args))
    cpu = {k: statistics.median(v) for k, v in times.items()}
    r = Result(
        title="9. Start-up",
        what=("CPU time (user + system) of `actdb query STORE \"SELECT 1\"` in a fresh "
              "process (the CLI's table output included), median of runs alternating with "
              "the other commands below, after one that writes the package's bytecode, as "
              "an installed package has it; for comparison a query that calls a function "
              f"(`{_COUNT}`: sqlglot reads it too), importing the four libraries every "
              "query needs (NumPy's BLAS threads left at their default), and the Python "
              "interpreter alone."),
    )
    r.figure("actdb query STORE \"SELECT 1\"", f"{cpu['select 1']:.2f} s CPU")
    r.figure(f"actdb query STORE \"{_COUNT}\"", f"{cpu['count']:.2f} s CPU")
    r.figure("python -c \"import numpy, duckdb, pyarrow, click\"", f"{cpu['imports']:.2f} s CPU")
    r.figure("python -c pass", f"{cpu['python']:.2f} s CPU")
    r.ratio("CPU seconds", cpu["select 1"], "<= 0.5", cpu["select 1"] <= 0.5)
    r.ratio("CPU seconds of a query calling a function", cpu["count"], "(information)", True)
    return r
