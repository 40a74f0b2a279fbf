"""The catalog rows of a flushed group of batches: new prompts, prompt runs, tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from .prompts import Prompt, column_value, extra_columns


@dataclass(frozen=True, kw_only=True)
class Work:
    """One prompt to run: its id in the store, its token ids, whether it is new."""

    prompt_id: int
    prompt: Prompt
    ids: list[int]
    truncated: bool
    new_prompt: bool


def batch_tables(
    batch: list[Work], start: int, token_str: list[str | None]
) -> tuple[pa.Table, pa.Table, pa.Table]:
    """(new prompts, prompt runs, tokens) for prompts whose rows start at `start`."""
    new = [w for w in batch if w.new_prompt]
    columns = sorted({k for w in new for k in w.prompt.extra})
    types = extra_columns([w.prompt for w in new])
    prompts = {
        "prompt_id": pa.array([w.prompt_id for w in new], pa.int64()),
        "text": pa.array([w.prompt.text for w in new], pa.string()),
        "n_tokens": pa.array([len(w.ids) for w in new], pa.int32()),
    }
    for c in columns:
        values = [column_value(w.prompt.extra.get(c), types[c]) for w in new]
        prompts[c] = pa.array(values)
    runs: list[tuple[int, int, int, bool]] = []
    tok_rows: dict[str, list[Any]] = {k: [] for k in ("prompt_id", "position", "token_id",
                                                      "token", "row")}
    row = start
    for w in batch:
        runs.append((w.prompt_id, row, len(w.ids), w.truncated))
        for pos, tid in enumerate(w.ids):
            tok_rows["prompt_id"].append(w.prompt_id)
            tok_rows["position"].append(pos)
            tok_rows["token_id"].append(tid)
            tok_rows["token"].append(token_str[tid] if tid < len(token_str) else None)
            tok_rows["row"].append(row)
            row += 1
    prompt_runs = pa.table({
        "prompt_id": pa.array([r[0] for r in runs], pa.int64()),
        "row_start": pa.array([r[1] for r in runs], pa.int64()),
        "n_tokens": pa.array([r[2] for r in runs], pa.int32()),
        "truncated": pa.array([r[3] for r in runs], pa.bool_()),
    })
    tokens = pa.table({
        "prompt_id": pa.array(tok_rows["prompt_id"], pa.int64()),
        "position": pa.array(tok_rows["position"], pa.int32()),
        "token_id": pa.array(tok_rows["token_id"], pa.int32()),
        "token": pa.array(tok_rows["token"], pa.string()),
        "row": pa.array(tok_rows["row"], pa.int64()),
    })
    return pa.table(prompts), prompt_runs, tokens
