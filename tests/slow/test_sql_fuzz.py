"""SQL fuzzing: SELECTs over acts with tensor functions and odd arguments never give a traceback
(only ActdbError subclasses), never hang and never return NaN."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import actdb
from actdb.query.functions import ANCHORS, DIRECTION, FUNCTIONS, INT, TOKEN, VEC, VECS

# (usual arguments, odd ones): a call draws an odd argument about one time in four.
HANDLES = (["a.vec", "normed(a.vec)", "normalized(a.vec)", "final_norm(a.vec)", "a2.vec"],
        ["normed(normed(a.vec))", "a.position", "a.prompt_id", "a.token_id", "NULL", "0", "-1",
         "9223372036854775807", "'x'", "1.5", "a.vec + 1", "a.vec + 100000", "NULL::BIGINT",
         "(SELECT max(vec) FROM acts)", "-a.vec"])
TOKENS = (["' the'", "'the'", "0", "1", "a.token", "a.token_id", "' Paris'"],
          ["''", "'zzzzqqq'", "-1", "100000", "NULL", "1.5", "'\u00e9\u00e9'", "'  '",
           "a.position", "99999999999"])
INTS = (["0", "1", "3", "a.position", "a.layer"],
        ["-1", "1000000000", "NULL", "2.5", "'a'", "9223372036854775807",
         "-9223372036854775808", "a.head"])
ANCHOR_ARGS = (["'unembed'", "'embed'", "'unembed_folded'"], ["'bogus'", "NULL", "''", "a.site"])
WHERES = ["", "WHERE a.prompt_id = 1", "WHERE a.position < 3", "WHERE a.site = 'final'",
          "WHERE a.role = 'pre_attn'", "WHERE a.head IS NULL", "WHERE vec_norm(a.vec) > 1",
          "WHERE false", "WHERE a.norm = 0"]
WRAPS = ["{}", "{}", "{}", "avg({})", "max({})", "count({})", "list({})[1]",
         "coalesce({}, NULL)", "CASE WHEN a.position > 1 THEN {} END"]

LISTS = (["[a.vec]", "[a.vec, a2.vec]", "(SELECT list(vec) FROM acts WHERE site = 'final')",
          "[normalized(a.vec), a.vec]"],
         ["[a.position]", "NULL", "[]", "[NULL]", "[a.vec, NULL]", "'x'", "[0]",
          "(SELECT list(vec) FROM acts)", "[-a.vec]"])
DIRECTIONS = (["to_list(a.vec)", "delta(a.vec)", "to_list(a2.vec)",
               "(SELECT mean_vector(list(vec)) FROM acts WHERE site = 'final')"],
              ["[1, 2, 3]", "NULL", "[]", "[NULL]", "'x'", "[1e39]", "to_list(normed(a.vec))",
               "list_transform(range(64), lambda i: 0.0)", "[a.position]"])

_ARGS = {VEC: HANDLES, VECS: LISTS, TOKEN: TOKENS, INT: INTS, ANCHORS: ANCHOR_ARGS,
         DIRECTION: DIRECTIONS}


@st.composite
def calls(draw: st.DrawFn) -> str:
    fn = draw(st.sampled_from(FUNCTIONS))
    lo, hi = fn.arity
    n = draw(st.integers(min_value=lo, max_value=hi))
    if draw(st.integers(0, 9)) == 0:  # now and then a wrong number of arguments
        n = draw(st.sampled_from([max(lo - 1, 0), hi + 1]))
    args = []
    for p in fn.params[:n]:
        usual, odd = _ARGS[p.kind]
        args.append(draw(st.sampled_from(odd if draw(st.integers(0, 3)) == 0 else usual)))
    args += [draw(st.sampled_from(INTS[0])) for _ in range(n - len(args))]
    return f"{fn.name}({', '.join(args)})"


@st.composite
def queries(draw: st.DrawFn) -> str:
    items = draw(st.lists(calls(), min_size=1, max_size=2))
    wrap = draw(st.sampled_from(WRAPS))
    aggregate = wrap.split("(")[0] in ("avg", "max", "count", "list")
    select = ", ".join(wrap.format(c) for c in items)
    where = draw(st.sampled_from(WHERES))
    join = " JOIN acts a2 USING (model, prompt_id, position)" if "a2." in select else ""
    tail = "" if aggregate else " LIMIT 40"
    return f"SELECT {select} FROM acts a{join} {where}{tail}"


def _floats(value: Any) -> Iterator[float]:
    if isinstance(value, float):
        yield value
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _floats(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _floats(v)


@pytest.fixture(scope="module")
def db(family_store: Callable[[str], Path]) -> Iterator[actdb.Database]:
    with actdb.connect(family_store("gpt2"), device="cpu") as database:
        yield database


@pytest.mark.slow
@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow])
@given(query=queries())
def test_fuzz_select_never_tracebacks_hangs_or_nans(db: actdb.Database, query: str) -> None:
    start = time.monotonic()
    try:
        rows = db.sql(query).fetchall()
    except actdb.ActdbError as e:
        # one sentence, not a Python or DuckDB exception passed through as text
        assert str(e) and "\n" not in str(e), query
        assert not re.search(r"\w+(Error|Exception)\b", str(e)), f"{query}: {e}"
        rows = []
    assert time.monotonic() - start < 30, f"slow: {query}"
    nan = [v for v in _floats(rows) if math.isnan(v)]
    assert not nan, f"NaN from {query}"
    # the session still works after every query
    assert db.sql("SELECT count(*) FROM acts").fetchall()[0][0] > 0
