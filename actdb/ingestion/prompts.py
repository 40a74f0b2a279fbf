"""Read prompts from a .txt file, a .jsonl file, standard input, or a Python list."""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import IngestError, PromptsError
from ..store.records import prompt_key

# The input fields that are no text: each is a path (a video may be a folder of frames).
MEDIA = ("image", "video", "audio")


@dataclass(frozen=True, kw_only=True)
class Media:
    """What of an input is no text: each field the path as given, or for an image object
    given in Python, `<image sha256:...>` of its pixels (`objects` holds the object)."""

    image: str | None = None
    video: str | None = None
    audio: str | None = None
    base: str | None = None  # the folder relative paths are read from (a JSONL file's)
    objects: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def fields(self) -> dict[str, str]:
        return {k: v for k in MEDIA if (v := getattr(self, k)) is not None}

    def path(self, value: str) -> Path:
        """A media path as given, read relative to the folder of the file that named it."""
        path = Path(value).expanduser()
        if self.base and not path.is_absolute():
            return Path(self.base) / path
        return path


@dataclass(frozen=True, kw_only=True)
class Prompt:
    text: str  # "" for an input of media alone (stored as NULL)
    extra: Mapping[str, Any] = field(default_factory=dict)
    media: Media | None = None

    @property
    def target(self) -> str | None:
        """What an encoder-decoder's decoder reads (teacher forcing): the `target` field."""
        value = self.extra.get("target")
        return value if isinstance(value, str) else None

    @property
    def key(self) -> str:
        """What makes two inputs one prompt: the text, the media paths where there are, and
        the target where there is one (records.prompt_key)."""
        m = self.media or Media()
        return prompt_key(self.text, m.image, m.video, m.audio, self.target)


PromptsLike = str | os.PathLike[str] | Iterable[str | Mapping[str, Any]]


FORMATS = ("txt", "jsonl")


def read_prompts(source: PromptsLike, *, format: str | None = None) -> list[Prompt]:
    """Prompts from a path (`.txt`: one per line; `.jsonl`: `text` plus extra fields),
    `-` for standard input (JSONL if its first line is a JSON object, else text), or a list
    of strings or dicts with a `text` key. `format` ('txt' or 'jsonl') overrides the file's
    suffix or the sniff of standard input.

    Lines end at a line feed, a CR or both: a prompt may hold any other character,
    Unicode's line and paragraph separators included. A UTF-8 byte-order mark at
    the start is not part of the first prompt."""
    if format is not None and format not in FORMATS:
        raise PromptsError(f"prompts format {format!r} is not one of {', '.join(FORMATS)}")
    if isinstance(source, str | os.PathLike):
        name = os.fspath(source)
        jsonl = None if format is None else format == "jsonl"
        if name == "-":
            lines = _lines(_decode(sys.stdin.buffer.read(), "<stdin>"))
            return _parse_lines(lines, "<stdin>", jsonl=jsonl, base=None)
        path = Path(name)
        if not path.is_file():
            raise PromptsError(f"prompts file {name!r} does not exist")
        lines = _lines(_decode(path.read_bytes(), name))
        if jsonl is None:
            jsonl = path.suffix.lower() in (".jsonl", ".ndjson")
        return _parse_lines(lines, name, jsonl=jsonl, base=str(path.parent))
    prompts = []
    wheres = []
    for i, item in enumerate(source):
        if isinstance(item, str):
            _check_encodable(item, f"prompts[{i}]", "its text")
            prompts.append(Prompt(text=item))
        elif isinstance(item, Mapping):
            prompts.append(_from_record(dict(item), f"prompts[{i}]", base=None))
        else:
            raise PromptsError(f"prompts[{i}] is a {type(item).__name__}, not a string or dict")
        wheres.append(f"prompts[{i}]")
    _check_fields(prompts, wheres)
    return _nonempty(prompts, "the prompts list")


def _lines(text: str) -> list[str]:
    """The file's lines: split at line feeds, CRLF and a lone CR (old Mac files) only;
    `str.splitlines` also splits at U+2028, U+0085, form feeds and more, which JSON strings
    and prompts may hold."""
    lines = _LINE_END.split(text)
    if lines and lines[-1] == "":
        lines.pop()
    return lines


_LINE_END = re.compile(r"\r\n|\r|\n")


def _decode(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8").removeprefix("\ufeff")  # a byte-order mark is no text
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise PromptsError(
            f"{where}, line {line}: not valid UTF-8 at byte {e.start} (column {column} of the "
            f"line, byte {data[e.start:e.start + 1]!r}); save the file as UTF-8"
        ) from None


def _parse_lines(lines: list[str], where: str, *, jsonl: bool | None, base: str | None
                 ) -> list[Prompt]:
    sniffed = jsonl is None
    if sniffed:  # stdin: sniff
        first = next((ln for ln in lines if ln.strip()), "")
        jsonl = first.lstrip().startswith("{")
    prompts = []
    wheres = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        wheres.append(f"{where}, line {n}")
        if not jsonl:
            prompts.append(Prompt(text=line))
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            hint = (" (read as JSON Lines because the first line starts with '{'; pass "
                    "--prompts-format txt, prompts_format='txt' in Python, for plain text)"
                    ) if sniffed else ""
            raise PromptsError(f"{where}, line {n}: not valid JSON ({e.msg}){hint}") from None
        if not isinstance(record, dict):
            raise PromptsError(f"{where}, line {n}: expected a JSON object with a 'text' field")
        prompts.append(_from_record(record, f"{where}, line {n}", base=base))
    _check_fields(prompts, wheres)
    return _nonempty(prompts, where)


def _from_record(record: dict[str, Any], where: str, *, base: str | None) -> Prompt:
    media = _media(record, where, base)
    text = record.pop("text", None)
    if media is not None and text is None:
        text = ""
    if not isinstance(text, str):
        raise PromptsError(f"{where}: has no 'text' string field"
                           + ("" if media is not None else
                              " (nor an 'image', 'video' or 'audio' field)"))
    _check_encodable(text, where, "its text")
    for key, value in record.items():
        if isinstance(key, str):
            _check_encodable(key, where, "a field name")
        _check_key(key, where)
        for inner in _strings(value):
            _check_encodable(inner, where, f"field {key!r}")
    return Prompt(text=text, extra=record, media=media)


def _media(record: dict[str, Any], where: str, base: str | None) -> Media | None:
    """The record's image, video and audio fields (popped), checked: each a path string, or
    for an image given in Python, a PIL image (named by a digest of its pixels)."""
    found: dict[str, str] = {}
    objects: dict[str, Any] = {}
    for key in MEDIA:
        if key not in record:
            continue
        value = record.pop(key)
        if value is None:
            continue
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if isinstance(value, str):
            if not value.strip():
                raise PromptsError(f"{where}: field {key!r} is empty; give a file's path")
            _check_encodable(value, where, f"field {key!r}")
            found[key] = value
        elif key == "image" and _is_pil(value):
            import hashlib

            digest = hashlib.sha256(value.tobytes() + repr((value.mode, value.size)).encode())
            found[key] = f"<image sha256:{digest.hexdigest()[:16]}>"
            objects[key] = value
        elif key == "audio" and _is_sound(value):
            import hashlib

            import numpy as np

            samples = np.ascontiguousarray(np.asarray(value[0], dtype=np.float32))
            digest = hashlib.sha256(samples.tobytes() + repr((samples.shape, int(value[1])))
                                    .encode())
            found[key] = f"<audio sha256:{digest.hexdigest()[:16]}>"
            objects[key] = (samples, int(value[1]))
        else:
            kinds = {"image": "a path or a PIL image",
                     "audio": "a path or an (array, sampling rate) pair"}.get(key, "a path")
            raise PromptsError(f"{where}: field {key!r} is a {type(value).__name__}, not "
                               f"{kinds}")
    if not found:
        return None
    return Media(**found, base=base, objects=objects)


def _is_sound(value: Any) -> bool:
    """An (array of samples, sampling rate) pair: [samples] or [samples, channels]."""
    return (isinstance(value, tuple) and len(value) == 2 and hasattr(value[0], "__len__")
            and isinstance(value[1], int) and not isinstance(value[1], bool) and value[1] > 0)


def _is_pil(value: Any) -> bool:
    return type(value).__module__.startswith("PIL.") and hasattr(value, "tobytes")


def _strings(value: Any) -> list[str]:
    """The strings in a JSON value, nested ones included."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (k, *_strings(v))]
    return []


def _check_encodable(text: str, where: str, what: str) -> None:
    """Text that UTF-8 can hold: JSON's escapes (and Python strings) can hold a lone half of
    a surrogate pair, which no tokenizer or database takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PromptsError(
            f"{where}: {what} holds a lone surrogate U+{ord(text[e.start]):04X} at character "
            f"{e.start} (half of a UTF-16 pair, no character on its own): write the whole "
            "pair or the character itself") from None


# Columns of `prompts` that actdb fills itself; SQL names ignore case, so neither may a field.
RESERVED = ("prompt_id", "text", "n_tokens", *MEDIA)


def _check_key(key: object, where: str) -> None:
    if not isinstance(key, str) or not key.strip():
        raise PromptsError(f"{where}: field name {key!r} is empty; every field needs a name")
    if any(not ch.isprintable() for ch in key):
        raise PromptsError(f"{where}: field name {key!r} holds control characters")
    if key.lower() in RESERVED:
        raise PromptsError(f"{where}: field {key!r} is reserved by actdb (the prompts columns "
                           f"{', '.join(RESERVED)} are filled by actdb, and names ignore case)")


def _kind(value: Any) -> str:
    """A field value's kind, as the error messages name it."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "a list" if isinstance(value, list) else "an object"


_NUMBERS = {"an integer", "a number"}


def _check_fields(prompts: list[Prompt], wheres: list[str]) -> None:
    """Each field keeps one kind over all prompts (integers and numbers mix), and no two field
    names differ only in case: each becomes one column of `prompts`."""
    seen: dict[str, tuple[str, str, str]] = {}  # lower name -> (name, kind, where)
    for p, where in zip(prompts, wheres, strict=True):
        for key, value in p.extra.items():
            if isinstance(value, int) and not isinstance(value, bool) and not (
                    -(1 << 63) <= value < (1 << 63)):
                raise PromptsError(f"{where}: field {key!r} = {value} does not fit a 64-bit "
                                   "integer; give it as a string or a number with a point")
            kind = _kind(value) if value is not None else None
            name, first_kind, first_where = seen.get(
                key.lower(), (key, kind or "", where.rsplit(", ", 1)[-1]))
            if name != key:
                raise PromptsError(f"{where}: field {key!r} differs only in case from field "
                                   f"{name!r} ({first_where}); column names ignore case")
            if kind and first_kind and kind != first_kind and not (
                    {kind, first_kind} <= _NUMBERS):
                raise PromptsError(f"{where}: field {key!r} is {kind} here but {first_kind} at "
                                   f"{first_where}; give each field one type")
            seen[key.lower()] = (key, first_kind or kind or "",
                                 first_where if first_kind else where.rsplit(", ", 1)[-1])


def _nonempty(prompts: list[Prompt], where: str) -> list[Prompt]:
    if not prompts:
        raise PromptsError(f"{where} holds no prompts")
    empty = next((i for i, p in enumerate(prompts) if not p.text.strip() and p.media is None),
                 None)
    if empty is not None:
        raise PromptsError(f"{where}: prompt {empty} is empty")
    return prompts


def extra_columns(prompts: list[Prompt]) -> dict[str, str]:
    """SQL types for the extra fields: BIGINT, DOUBLE, BOOLEAN or VARCHAR (JSON text); NULL
    for a field that is null in every prompt here (it fits any column)."""
    types: dict[str, set[str]] = {}
    for p in prompts:
        for k, v in p.extra.items():
            types.setdefault(k, set()).add(_sql_type(v))
    out = {}
    for k, ts in types.items():
        ts.discard("NULL")
        if not ts:
            out[k] = "NULL"
        elif ts <= {"BOOLEAN"}:
            out[k] = "BOOLEAN"
        elif ts <= {"BIGINT"}:
            out[k] = "BIGINT"
        elif ts <= {"BIGINT", "DOUBLE"}:
            out[k] = "DOUBLE"
        else:
            out[k] = "VARCHAR"
    return out


def column_value(value: Any, sqltype: str) -> Any:
    """A field's value as its column holds it: JSON text in a VARCHAR column; a float in a
    DOUBLE one (an integer past 2^53 is rounded, as the column would, not refused by Arrow)."""
    if value is None:
        return None
    if sqltype == "VARCHAR" and not isinstance(value, str):
        return json.dumps(value)
    if sqltype == "DOUBLE" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
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


def apply_chat_template(prompts: list[Prompt], tokenizer: Any, model: str) -> list[Prompt]:
    """Each prompt as the user turn of a chat, rendered by the tokenizer's own template with
    the assistant's turn opened (what an instruct model sees before it answers)."""
    if not getattr(tokenizer, "chat_template", None):
        raise IngestError(f"the tokenizer of model {model!r} has no chat template; ingest "
                          "without --chat-template (chat_template=False)")
    out = []
    for p in prompts:
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": p.text}],
                                                 tokenize=False, add_generation_prompt=True)
        except Exception as e:  # a template's own error (Jinja), named with the prompt
            raise IngestError(f"the chat template of model {model!r} failed on prompt "
                              f"{p.text[:60]!r}: {e}") from None
        out.append(replace(p, text=str(text)))
    return out
