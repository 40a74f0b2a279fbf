"""The catalog rows of a flushed group of batches: new prompts, prompt runs, tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from .inputs import Positions
from .prompts import Prompt, column_value, extra_columns


@dataclass(frozen=True, kw_only=True)
class Work:
    """One prompt to run: its id in the store, its token ids, whether it is new."""

    prompt_id: int
    prompt: Prompt
    ids: list[int]
    truncated: bool
    new_prompt: bool
    positions: Positions | None = None  # a media input's positions (ids are then -1)


def batch_tables(
    batch: list[Work], start: int, token_str: list[str | None]
) -> tuple[pa.Table, pa.Table, pa.Table]:
    """(new prompts, prompt runs, tokens) for prompts whose rows start at `start`."""
    new = [w for w in batch if w.new_prompt]
    columns = sorted({k for w in new for k in w.prompt.extra})
    types = extra_columns([w.prompt for w in new])
    prompts = {
        "prompt_id": pa.array([w.prompt_id for w in new], pa.int64()),
        # an input of media alone has no text: NULL, not an empty prompt
        "text": pa.array([w.prompt.text if w.prompt.text or w.prompt.media is None else None
                          for w in new], pa.string()),
        "n_tokens": pa.array([len(w.ids) for w in new], pa.int32()),
    }
    for c in columns:
        values = [column_value(w.prompt.extra.get(c), types[c]) for w in new]
        prompts[c] = pa.array(values)
    for m in sorted({k for w in new if w.prompt.media for k in w.prompt.media.fields()}):
        prompts[m] = pa.array([w.prompt.media.fields().get(m) if w.prompt.media else None
                               for w in new], pa.string())
    runs: list[tuple[int, int, int, bool]] = []
    tok_rows: dict[str, list[Any]] = {k: [] for k in ("prompt_id", "position", "token_id",
                                                      "token", "row", "patch_row",
                                                      "patch_col", "frame", "grid")}
    row = start
    for w in batch:
        runs.append((w.prompt_id, row, len(w.ids), w.truncated))
        labels = w.positions
        for pos, tid in enumerate(w.ids):
            tok_rows["prompt_id"].append(w.prompt_id)
            tok_rows["position"].append(pos)
            if labels is not None:  # a position of an image: no token of a vocabulary
                tok_rows["token_id"].append(None)
                tok_rows["token"].append(labels.tokens[pos])
            else:
                tok_rows["token_id"].append(tid)
                tok_rows["token"].append(token_str[tid] if tid < len(token_str) else None)
            for k in ("patch_row", "patch_col", "frame"):
                tok_rows[k].append(getattr(labels, k)[pos] if labels is not None else None)
            tok_rows["grid"].append(labels.grid[pos] if labels is not None and labels.grid
                                    else None)
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
        **{k: pa.array(tok_rows[k], pa.int32()) for k in ("patch_row", "patch_col", "frame",
                                                          "grid")},
    })
    return pa.table(prompts), prompt_runs, tokens
