"""Which prompts an ingest runs: the input's prompts with their store ids, less those the
model already has; and what of the input's prompt fields the store will not hold."""

from __future__ import annotations

from typing import Any

from ..store.store import Store
from .inputs import Positions
from .prompts import Prompt, column_value, extra_columns
from .rows import Work


def plan_work(
    st: Store, model: str, prompts: list[Prompt], ids: list[list[int]], truncated: list[bool],
    labels: Positions | list[Positions] | None = None,
    decoders: list[list[int]] | None = None,
) -> tuple[list[Work], dict[str, int]]:
    """The prompts still to run, and the ids of those prompts (by `Prompt.key`: the text, and
    the media paths and target where there are) the store already holds; `labels`: what each
    position of a media input is (one for every input, or each input's: text and images
    together); `decoders`: an encoder-decoder's decoder tokens."""
    with st.catalog.session():  # three reads, one open of the file
        known = st.catalog.prompt_ids([p.text for p in prompts if p.key == p.text])
        known.update(st.catalog.media_prompt_ids()
                     if any(p.key != p.text for p in prompts) else {})
        done = st.catalog.ingested_prompt_ids(model)
        next_id = st.catalog.next_prompt_id()
    assigned: dict[str, int] = {}
    work = []
    each = labels if isinstance(labels, list) else [labels] * len(prompts)
    for k, (p, i, t) in enumerate(zip(prompts, ids, truncated, strict=True)):
        if p.key in assigned:
            continue  # the same text (and media) twice in one input is one prompt
        pid = known.get(p.key)
        if pid is None:
            pid, next_id = next_id, next_id + 1
        assigned[p.key] = pid
        if pid not in done and len(i) > 0:
            work.append(Work(prompt_id=pid, prompt=p, ids=i, truncated=t,
                              new_prompt=p.key not in known, positions=each[k],
                              decoder=None if decoders is None else decoders[k]))
    columns = extra_columns([w.prompt for w in work if w.new_prompt])
    columns.update({k: "VARCHAR" for w in work if w.new_prompt and w.prompt.media
                    for k in w.prompt.media.fields()})
    if columns:
        st.catalog.add_prompt_columns(columns)
    return work, known


def same_field(a: Any, b: Any) -> bool:
    """Whether two values of a prompt field are the same: NaN is NaN (a missing value of a
    DataFrame's records), and numbers compare as numbers."""
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    return bool(a == b)


def fields_not_stored(st: Store, prompts: list[Prompt], known: dict[str, int]) -> list[str]:
    """Sentences on the input's prompt fields that the store will not hold, each text being
    one prompt: fields of a text repeated in the input that differ from its first
    occurrence's, and fields of a prompt already stored (`known`: text -> id, from
    `plan_work`) that differ from its stored ones (the stored prompt keeps its own). Called
    after `plan_work`, so new prompts' columns exist."""
    first: dict[str, Prompt] = {}
    repeated = []
    for p in prompts:
        f = first.setdefault(p.key, p)
        if f is not p and (p.extra.keys() != f.extra.keys() or not all(
                same_field(v, f.extra[k]) for k, v in p.extra.items())):
            repeated.append(p)
    out = []
    if repeated:
        out.append(f"{len(repeated)} prompts repeat an earlier prompt's text with other fields "
                   f"(first: {repeated[0].text[:40]!r}): a text is one prompt, stored with the "
                   "fields it first came with")
    with_fields = [p for p in first.values() if p.extra and p.key in known]
    if not with_fields:
        return out
    with st.catalog.session():
        names = sorted({k for p in with_fields for k in p.extra})
        types = {k.lower(): v for k, v in st.catalog.prompt_columns().items()}
        stored = st.catalog.prompt_fields(sorted({known[p.key] for p in with_fields}), names)
    differ: dict[str, int] = {}
    for p in with_fields:
        have = {k.lower(): v for k, v in stored.get(known[p.key], {}).items()}
        for k, v in p.extra.items():
            new = column_value(v, types.get(k.lower(), ""))  # as the column holds it
            if new is not None and not same_field(new, have.get(k.lower())):
                differ[k] = differ.get(k, 0) + 1
    if differ:
        fields = ", ".join(f"{k} ({n} prompt{'s' if n > 1 else ''})"
                           for k, n in sorted(differ.items()))
        out.append("prompts already in the store keep the fields they were stored with; this "
                   f"input gives other values for {fields}: to attach new fields, join a table "
                   "(actdb query --table, db.register)")
    return out
