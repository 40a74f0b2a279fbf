"""Read prompts from a .txt file, a .jsonl file, standard input, or a Python list."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import PromptsError


@dataclass(frozen=True, kw_only=True)
class Prompt:
    text: str
    extra: Mapping[str, Any] = field(default_factory=dict)


PromptsLike = str | os.PathLike[str] | Iterable[str | Mapping[str, Any]]


def read_prompts(source: PromptsLike) -> list[Prompt]:
    """Prompts from a path (`.txt`: one per line; `.jsonl`: `text` plus extra fields),
    `-` for standard input (JSONL if its first line is a JSON object, else text), or a list
    of strings or dicts with a `text` key."""
    if isinstance(source, str | os.PathLike):
        name = os.fspath(source)
        if name == "-":
            return _parse_lines(sys.stdin.read().splitlines(), "<stdin>", jsonl=None)
        path = Path(name)
        if not path.is_file():
            raise PromptsError(f"prompts file {name!r} does not exist")
        lines = path.read_text(encoding="utf-8").splitlines()
        return _parse_lines(lines, name, jsonl=path.suffix.lower() in (".jsonl", ".ndjson"))
    prompts = []
    for i, item in enumerate(source):
        if isinstance(item, str):
            prompts.append(Prompt(text=item))
        elif isinstance(item, Mapping):
            prompts.append(_from_record(dict(item), f"prompts[{i}]"))
        else:
            raise PromptsError(f"prompts[{i}] is a {type(item).__name__}, not a string or dict")
    return _nonempty(prompts, "the prompts list")


def _parse_lines(lines: list[str], where: str, *, jsonl: bool | None) -> list[Prompt]:
    if jsonl is None:  # stdin: sniff
        first = next((ln for ln in lines if ln.strip()), "")
        jsonl = first.lstrip().startswith("{")
    prompts = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if not jsonl:
            prompts.append(Prompt(text=line))
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptsError(f"{where}, line {n}: not valid JSON ({e.msg})") from None
        if not isinstance(record, dict):
            raise PromptsError(f"{where}, line {n}: expected a JSON object with a 'text' field")
        prompts.append(_from_record(record, f"{where}, line {n}"))
    return _nonempty(prompts, where)


def _from_record(record: dict[str, Any], where: str) -> Prompt:
    text = record.pop("text", None)
    if not isinstance(text, str):
        raise PromptsError(f"{where}: has no 'text' string field")
    reserved = {"prompt_id", "n_tokens"} & {k.lower() for k in record}
    if reserved:
        raise PromptsError(f"{where}: field {sorted(reserved)[0]!r} is reserved by actdb")
    return Prompt(text=text, extra=record)


def _nonempty(prompts: list[Prompt], where: str) -> list[Prompt]:
    if not prompts:
        raise PromptsError(f"{where} holds no prompts")
    empty = next((i for i, p in enumerate(prompts) if not p.text.strip()), None)
    if empty is not None:
        raise PromptsError(f"{where}: prompt {empty} is empty")
    return prompts


def extra_columns(prompts: list[Prompt]) -> dict[str, str]:
    """SQL types for the extra fields: BIGINT, DOUBLE, BOOLEAN or VARCHAR (JSON text)."""
    types: dict[str, set[str]] = {}
    for p in prompts:
        for k, v in p.extra.items():
            types.setdefault(k, set()).add(_sql_type(v))
    out = {}
    for k, ts in types.items():
        ts.discard("NULL")
        if ts <= {"BOOLEAN"} and ts:
            out[k] = "BOOLEAN"
        elif ts <= {"BIGINT"} and ts:
            out[k] = "BIGINT"
        elif ts <= {"BIGINT", "DOUBLE"} and ts:
            out[k] = "DOUBLE"
        else:
            out[k] = "VARCHAR"
    return out


def column_value(value: Any, sqltype: str) -> Any:
    if value is None:
        return None
    if sqltype == "VARCHAR" and not isinstance(value, str):
        return json.dumps(value)
    return value


def _sql_type(v: Any) -> str:
    if v is None:
        return "NULL"
    if isinstance(v, bool):
        return "BOOLEAN"
    if isinstance(v, int):
        return "BIGINT"
    if isinstance(v, float):
        return "DOUBLE"
    return "VARCHAR"
