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
    # an encoder-decoder's: the tokens its decoder reads (the target shifted right, or the
    # decoder's start token alone); `ids` are then its encoder's input
    decoder: list[int] | None = None

    @property
    def n_rows(self) -> int:
        """The rows it stores: a position of its input each, and of its decoder's tokens."""
        return len(self.ids) + len(self.decoder or ())


def batch_tables(
    batches: list[list[Work]], start: int, token_str: list[str | None]
) -> tuple[pa.Table, pa.Table, pa.Table]:
    """(new prompts, prompt runs, tokens) for batches whose rows start at `start`. A batch's
    rows are its prompts' in order; an encoder-decoder batch's are its prompts' encoder
    rows, then their decoder rows (the order the ingest's sink stores them in), each a run
    of its tower."""
    new = [w for b in batches for w in b if w.new_prompt]
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
    towers = any(w.decoder is not None for b in batches for w in b)
    runs: dict[str, list[Any]] = {k: [] for k in ("prompt_id", "row_start", "n_tokens",
                                                  "truncated", "tower")}
    tok_rows: dict[str, list[Any]] = {k: [] for k in ("prompt_id", "position", "token_id",
                                                      "token", "row", "patch_row",
                                                      "patch_col", "frame", "grid",
                                                      "tower")}
    row = start
    for batch in batches:
        seqs = [(w, w.ids, w.positions, "encoder" if towers else None) for w in batch]
        seqs += [(w, w.decoder or [], None, "decoder") for w in batch if towers]
        for w, ids, labels, tower in seqs:
            for k, v in (("prompt_id", w.prompt_id), ("row_start", row),
                         ("n_tokens", len(ids)), ("truncated", w.truncated), ("tower", tower)):
                runs[k].append(v)
            for pos, tid in enumerate(ids):
                tok_rows["prompt_id"].append(w.prompt_id)
                tok_rows["position"].append(pos)
                if labels is not None and tid < 0:  # an image's or a sound's: no token
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
                tok_rows["tower"].append(tower)
                row += 1
    prompt_runs = pa.table({
        "prompt_id": pa.array(runs["prompt_id"], pa.int64()),
        "row_start": pa.array(runs["row_start"], pa.int64()),
        "n_tokens": pa.array(runs["n_tokens"], pa.int32()),
        "truncated": pa.array(runs["truncated"], pa.bool_()),
        **({"tower": pa.array(runs["tower"], pa.string())} if towers else {}),
    })
    tokens = pa.table({
        "prompt_id": pa.array(tok_rows["prompt_id"], pa.int64()),
        "position": pa.array(tok_rows["position"], pa.int32()),
        "token_id": pa.array(tok_rows["token_id"], pa.int32()),
        "token": pa.array(tok_rows["token"], pa.string()),
        "row": pa.array(tok_rows["row"], pa.int64()),
        **{k: pa.array(tok_rows[k], pa.int32()) for k in ("patch_row", "patch_col", "frame",
                                                          "grid")},
        **({"tower": pa.array(tok_rows["tower"], pa.string())} if towers else {}),
    })
    return pa.table(prompts), prompt_runs, tokens
