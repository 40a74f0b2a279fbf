"""Token arguments of query functions: a string that must be one token of the model's
vocabulary, or a token id, resolved against the stored vocabulary (and the stored tokenizer,
to say how a string that is no token tokenizes)."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from ..errors import QueryError, TokenError
from ..lazy import lazy_module
from ..store.records import ModelRecord
from ..store.store import Store

if TYPE_CHECKING:
    import pyarrow as pa
else:
    pa = lazy_module("pyarrow")  # imported when Arrow data is first made or read

INT_TYPES = {"TINYINT", "SMALLINT", "INTEGER", "BIGINT", "HUGEINT", "UTINYINT", "USMALLINT",
             "UINTEGER", "UBIGINT", "UHUGEINT"}
# Token strings a connection finds by a scan of the vocabulary before it builds a dict of it.
_STRINGS_ALONE = 16


class Vocabulary:
    """Each model's token strings, and token arguments resolved to ids (kept once resolved)."""

    def __init__(self, store: Store, models: dict[int, ModelRecord]) -> None:
        self.store, self.models = store, models
        self._lock = threading.RLock()
        self._vocab: dict[int, dict[str, list[int]]] = {}  # string -> ids, once many are asked
        self._strings_alone: dict[int, int] = {}
        self._vocab_column: dict[int, Any] = {}  # each model's tokens (read_vocabularies)
        self._vocabularies_read = False
        self._token_ids: dict[tuple[int, str, str], int] = {}
        self._tokenizers: dict[int, Any] = {}  # _tokenizer

    def read_vocabularies(self) -> None:
        """Read each model's token strings as Arrow (a few ms for 50,257 strings; Python
        strings are made on first use). Called before the first query that calls a tensor
        function is bound (execute.Functions.register): UDFs run inside a query on the catalog
        connection and may not use it, and a query that calls none (`SELECT 1`) should import
        neither pyarrow nor read the vocabulary."""
        with self._lock:
            if self._vocabularies_read:
                return
            for m in self.models.values():
                self._vocab_column[m.model_id] = self.store.catalog.con.sql(
                    "SELECT token FROM vocab WHERE model = $1 ORDER BY token_id",
                    params=[m.model]).to_arrow_table().column(0)
            self._vocabularies_read = True

    def token_column(self, model: ModelRecord) -> pa.Array:
        """Each token id's string as one Arrow array (NULL where the vocabulary has none)."""
        if not self._vocabularies_read:  # a caller outside any query (a query reads them first)
            self.read_vocabularies()
        column = self._vocab_column[model.model_id]
        if not isinstance(column, pa.Array):
            with self._lock:
                column = self._vocab_column[model.model_id]
                if not isinstance(column, pa.Array):
                    column = column.combine_chunks()
                    if not len(column):
                        column = pa.array([], pa.string())
                    self._vocab_column[model.model_id] = column
        return column

    def resolve_token(self, model: ModelRecord, value: str, sqltype: str) -> int:
        """A token argument (a string that is one token, or a token id) -> token id."""
        key = (model.model_id, value, sqltype)
        if key not in self._token_ids:
            self._token_ids[key] = self._resolve_token(model, value, sqltype)
        return self._token_ids[key]

    def _resolve_token(self, model: ModelRecord, value: str, sqltype: str) -> int:
        column = self.token_column(model)
        size = len(column)
        if sqltype.upper() in INT_TYPES:
            tid = int(value)
            if not 0 <= tid < size:
                raise QueryError(
                    f"token id {tid} is out of range for model {model.model!r} "
                    f"(vocabulary of {size})"
                )
            return tid
        if sqltype.upper() != "VARCHAR":  # a list, a boolean, a struct: no token, said so
            raise TokenError(f"a token is a string or a token id, not a value of type "
                             f"{sqltype} ({value!r})")
        ids = self._ids_of_string(model, column, value)
        encoded = self._encode(model, value) if len(ids) != 1 else None
        if len(ids) > 1 and encoded and len(encoded) == 1 and encoded[0] in ids:
            return encoded[0]
        if len(ids) == 1:
            return ids[0]
        if ids:  # several tokens decode to this text and the tokenizer picks none of them
            shown = ", ".join(str(i) for i in ids[:8]) + (", ..." if len(ids) > 8 else "")
            raise TokenError(
                f"{value!r} is the text of {len(ids)} tokens of model {model.model!r} (ids "
                f"{shown}): pass the token id instead")
        how = ": the empty string is no token" if value == "" else ""
        unknown = getattr(self._tokenizer(model), "unk_token_id", None) if encoded else None
        if encoded and len(encoded) == 1 and encoded[0] == unknown:
            how = ": its tokenizer does not know it (it reads it as its unknown token)"
        elif encoded and len(encoded) == 1:  # a tokenizer that normalizes (BERT's lowercasing)
            piece = column[encoded[0]].as_py() if encoded[0] < size else None
            how = (f": no token's text is {value!r}; the tokenizer reads it as the one token "
                   f"{piece!r} (id {encoded[0]}): pass {piece!r} or {encoded[0]}")
        elif encoded:
            pieces = [column[i].as_py() if i < size else str(i) for i in encoded]
            how = f": it tokenizes as {pieces} ({len(encoded)} tokens)"
        from .display import shown_whitespace, unshown

        if shown_whitespace(value):  # copied from the table output, where a space shows as ␣
            how += (f" (in the table output {', '.join(shown_whitespace(value))}; write "
                    f"{unshown(value)!r})")
        raise TokenError(f"{value!r} is not one token of model {model.model!r}{how}")

    def _ids_of_string(self, model: ModelRecord, column: pa.Array, value: str) -> list[int]:
        """The ids whose string is `value`, in id order. The first few strings a connection
        resolves take one Arrow comparison each (a dict of a whole vocabulary would cost a
        fresh process's first query more than the query itself); past `_STRINGS_ALONE`, as
        for a column of many token strings, the dict is built once and used."""
        with self._lock:
            index = self._vocab.get(model.model_id)
            if index is None and self._strings_alone.get(model.model_id, 0) >= _STRINGS_ALONE:
                index = {}
                for i, text in enumerate(column.to_pylist()):
                    if text is not None:
                        index.setdefault(text, []).append(i)
                self._vocab[model.model_id] = index
            if index is not None:
                return index.get(value, [])
            self._strings_alone[model.model_id] = self._strings_alone.get(model.model_id, 0) + 1
        import pyarrow.compute as pc

        same = pc.fill_null(pc.equal(column, pa.scalar(value, pa.string())), False)
        return [int(i) for i in pc.indices_nonzero(same).to_pylist()]

    def _tokenizer(self, model: ModelRecord) -> Any:
        """The model's stored tokenizer (None when the store has none), loaded once."""
        if model.model_id not in self._tokenizers:
            folder = self.store.tokenizer_dir(model.model_id)
            tok = None
            if folder.is_dir():
                from transformers import AutoTokenizer

                try:  # a store's folder may come from anyone: its code never runs
                    tok = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
                except ValueError as e:
                    if "trust_remote_code" not in str(e):
                        raise
                    # one that only its own code loads: tokens resolve by the vocab table
                    # alone, as in a store without a tokenizer
            self._tokenizers[model.model_id] = tok
        return self._tokenizers[model.model_id]

    def _encode(self, model: ModelRecord, text: str) -> list[int] | None:
        tok = self._tokenizer(model)
        return None if tok is None else list(tok(text, add_special_tokens=False)["input_ids"])
