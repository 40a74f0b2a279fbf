"""Fill a store with synthetic vectors through the store's own API (no model, fixed seed).

The store looks like an ingest of a GPT-2-small-shaped model: `n_sites` LayerNorm sites of
width d, prompts of `prompt_tokens` tokens, a tied vocabulary of `vocab` tokens named "w{i}".
Vectors are random directions with log-normal norms; they go through Store.commit_batch,
the same commit protocol an ingest uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from actdb.store.arrays import default_chunk_tokens
from actdb.store.records import ModelRecord, SiteRecord
from actdb.store.store import ActBatch, Store


@dataclass(frozen=True, kw_only=True)
class Shape:
    d: int = 768
    vocab: int = 50257
    n_sites: int = 4
    prompt_tokens: int = 128
    batch_tokens: int = 16384


def vectors(rng: np.random.Generator, n: int, d: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(direction float16 [n, d], norm float32 [n], mean float32 [n]) of random vectors."""
    x = rng.standard_normal((n, d), dtype=np.float32) + 0.05
    x *= np.exp(rng.normal(2.0, 0.5, size=(n, 1))).astype(np.float32)
    norm = np.linalg.norm(x, axis=1)
    return (x / norm[:, None]).astype(np.float16), norm.astype(np.float32), x.mean(1)


def generate(path: Path, *, tokens: int, shape: Shape, seed: int = 0) -> None:
    """Make (or grow) the store at `path` to hold `tokens` token rows of every site."""
    rng = np.random.default_rng(seed)
    with Store.open_or_create(path) as st:
        sites = [
            SiteRecord(site=f"blocks.{i}.ln1", site_id=i, layer=i, role="pre_attn",
                       kind="layernorm", d=shape.d, n_heads=None, eps=1e-5,
                       module=f"transformer.h.{i}.ln_1", has_gain=True, has_bias=True)
            for i in range(shape.n_sites)
        ]
        model = st.catalog.model("synthetic")
        if model is None:
            model = ModelRecord(
                model="synthetic", model_id=0, source="benchmarks/generate.py", revision=None,
                architecture="GPT2LMHeadModel", d_model=shape.d, n_layers=shape.n_sites,
                vocab_size=shape.vocab, n_sites=shape.n_sites, has_lm_head=True,
                has_lm_head_bias=False, tied_embeddings=True, final_site=None,
                dtype="float32", max_length=None, sites_glob=None,
                chunk_tokens=default_chunk_tokens(shape.d),
            )
            embed = rng.standard_normal((shape.vocab, shape.d), dtype=np.float32) * 0.1
            vocab = pa.table({
                "token_id": pa.array(range(shape.vocab), pa.int32()),
                "token": pa.array([f"w{i}" for i in range(shape.vocab)]),
                "piece": pa.array([f"w{i}" for i in range(shape.vocab)]),
            })
            ones = np.ones(shape.d, np.float32)
            st.register_model(
                model, sites, embed=embed, lm_head=None, lm_head_bias=None,
                site_params={s.site: (ones, ones * 0) for s in sites}, vocab=vocab,
            )
        start = model.n_rows
        if start >= tokens:
            return
        st.reserve_rows(model, sites, tokens)
        next_prompt = st.catalog.next_prompt_id()
        rng = np.random.default_rng(seed + start)  # growing a store adds the same rows
        while start < tokens:
            n_prompts = max(1, min(shape.batch_tokens, tokens - start) // shape.prompt_tokens)
            n = n_prompts * shape.prompt_tokens
            ids = np.arange(next_prompt, next_prompt + n_prompts, dtype=np.int64)
            acts = {}
            for s in sites:
                d16, norm, mean = vectors(rng, n, shape.d)
                acts[s.site] = ActBatch(direction=d16, norm=norm, mean=mean)
            token_ids = rng.integers(0, shape.vocab, n)
            prompts = pa.table({
                "prompt_id": pa.array(ids),
                "text": pa.array([f"synthetic prompt {i}" for i in ids]),
                "n_tokens": pa.array([shape.prompt_tokens] * n_prompts, pa.int32()),
            })
            runs = pa.table({
                "prompt_id": pa.array(ids),
                "row_start": pa.array(start + np.arange(n_prompts) * shape.prompt_tokens),
                "n_tokens": pa.array([shape.prompt_tokens] * n_prompts, pa.int32()),
                "truncated": pa.array([False] * n_prompts),
            })
            toks = pa.table({
                "prompt_id": pa.array(np.repeat(ids, shape.prompt_tokens)),
                "position": pa.array(np.tile(np.arange(shape.prompt_tokens, dtype=np.int32),
                                             n_prompts)),
                "token_id": pa.array(token_ids.astype(np.int32)),
                "token": pa.array([f"w{t}" for t in token_ids]),
                "row": pa.array(np.arange(start, start + n, dtype=np.int64)),
            })
            start = st.commit_batch(model, start=start, acts=acts, new_prompts=prompts,
                                    prompt_runs=runs, tokens=toks, site_errors={})
            next_prompt += n_prompts
