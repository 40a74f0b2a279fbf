"""Split a query into a per-partition query and a combining query, or say why it cannot be.

A whitelist of shapes whose split is provably the same as the whole: one SELECT over `acts`
alone (no join, subquery, CTE, window, DISTINCT, sampling), where every row of `acts` belongs
to exactly one partition. Then
- plain rows: each partition runs the query (with its ORDER BY and LIMIT k + OFFSET, ORDER BY
  keys carried as hidden columns); the combine sorts the partials again and applies LIMIT and
  OFFSET once, or, without ORDER BY, concatenates them in partition order.
- aggregates: each partition computes partial aggregates per group (count, sum, min, max; avg
  as sum and count), hidden group key columns beside them; the combine groups again and folds
  them (count and sum by sum, min by min, max by max, avg as sum / count), then applies
  HAVING, ORDER BY and LIMIT over the folded values.
Anything else raises `Unsplittable` with the reason, and the query runs in one process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sqlglot import exp

from .functions import REGISTRY

PARTS = "_actdb_parts"  # the table of partial rows in the combining query
_KEY = "_actdb_k"  # hidden ORDER BY keys (rows) or group keys (aggregates)
_AGG = "_actdb_a"  # hidden partial aggregates
_FOLDS: dict[type[exp.Expr], str] = {exp.Count: "count", exp.Sum: "sum", exp.Min: "min",
                                     exp.Max: "max", exp.Avg: "avg"}


class Unsplittable(Exception):
    """The query is not a shape whose split is known to be exact; the reason says why."""


@dataclass(frozen=True, kw_only=True)
class Split:
    """A query cut in two: `partial(table)` runs on each partition (with `table` standing for
    that partition's rows of acts), `combine(columns, types)` over the partials' union."""

    kind: str  # "rows" or "aggregate"
    partial_tree: exp.Select
    hidden: tuple[str, ...]  # partial columns that are not the query's own
    final: Callable[[list[str], list[str]], str | None]  # None: concatenate in order
    limit: int | None
    offset: int

    def partial(self, table: exp.Expr) -> str:
        """The per-partition SQL, with `table` (a subquery) in place of acts."""
        tree = self.partial_tree.copy()
        source = tree.args["from_"].this
        alias = source.alias or "acts"
        source.replace(exp.Subquery(this=table, alias=exp.TableAlias(
            this=exp.to_identifier(alias))))
        return tree.sql(dialect="duckdb")

    def combine(self, n_outputs: int, types: list[str]) -> str | None:
        """The combining SQL over PARTS (outputs `_c0..`), or None to concatenate."""
        return self.final([f"_c{i}" for i in range(n_outputs)], types)


def split(tree: exp.Expr, aggregates: set[str]) -> Split:
    """The split of a parsed query; Unsplittable with the reason when there is none.

    Args:
        tree: sqlglot's tree of the checked SELECT (DuckDB dialect).
        aggregates: the names of DuckDB's aggregate functions (lower case), so that one
            sqlglot does not know as an aggregate is still seen as one.
    """
    select = _check_shape(tree, aggregates)
    if _is_aggregate(select):
        return _split_aggregate(select)
    return _split_rows(select)


# -- shape ---------------------------------------------------------------------------------


def _check_shape(tree: exp.Expr, aggregates: set[str]) -> exp.Select:
    if not isinstance(tree, exp.Select):
        raise Unsplittable(f"a {tree.key.upper()} is not split; only a plain SELECT is")
    for key in ("with_", "with", "joins", "laterals", "qualify", "pivots", "sample",
                "connect", "match", "prewhere", "windows", "into", "kind", "settings",
                "cluster", "distribute", "sort", "locks", "options", "format"):
        if tree.args.get(key):
            raise Unsplittable(f"the query uses {key.strip('_').upper()}, which is not split")
    if tree.args.get("distinct"):
        raise Unsplittable("SELECT DISTINCT is not split")
    source = tree.args.get("from_")
    table = source.this if source else None
    if not isinstance(table, exp.Table) or table.name.lower() != "acts" or table.args.get(
            "db") or table.args.get("catalog") or table.args.get("joins"):
        raise Unsplittable("only a query over acts alone is split (its rows are what the "
                           "partitions divide)")
    if isinstance(table.args.get("alias"), exp.TableAlias) and table.args["alias"].columns:
        raise Unsplittable("acts with renamed columns (AS a(x, y, ...)) is not split")
    for node in tree.walk():
        if node is not tree and isinstance(node, exp.Select | exp.SetOperation | exp.Subquery):
            raise Unsplittable("a query with a subquery is not split")
        if isinstance(node, exp.Window):
            raise Unsplittable("window functions see rows of other partitions; not split")
        if isinstance(node, exp.TableSample | exp.Lateral | exp.Unnest | exp.Join):
            raise Unsplittable(f"{node.key.upper()} is not split")
        if isinstance(node, exp.Columns):  # one expression standing for several columns
            raise Unsplittable("COLUMNS(...) is not split")
        if isinstance(node, exp.Ordered) and isinstance(node.this, exp.Var) and (
                node.this.name.upper() == "ALL"):
            raise Unsplittable("ORDER BY ALL is not split")
        if isinstance(node, exp.Table) and node is not table:
            raise Unsplittable("a query naming another table is not split")
        if isinstance(node, exp.Func) and _aggregate_kind(node, aggregates) == "other":
            raise Unsplittable(f"the aggregate {_shown(node)} is not split (only count, "
                               "sum, min, max and avg are, without DISTINCT or ORDER BY)")
        if isinstance(node, exp.Placeholder | exp.Parameter) and not _inside(
                node, tree.args.get("where")):
            raise Unsplittable("parameters are split only inside WHERE")
    for part in ("limit", "offset"):
        clause = tree.args.get(part)
        if clause is not None and _int_literal(clause.expression) is None:
            raise Unsplittable(f"{part.upper()} is split only as a plain number")
    return tree


def _aggregate_kind(node: exp.Func, aggregates: set[str]) -> str | None:
    """'fold' for an aggregate we fold, 'other' for any other aggregate, None otherwise."""
    if type(node) in _FOLDS:
        this = node.this
        extra = {k for k, v in node.args.items() if v} - {"this", "big_int"}
        if extra or isinstance(this, exp.Distinct | exp.Order):  # min(x, n), DISTINCT, ...
            return "other"
        if isinstance(node, exp.Count) and this is None:
            return "other"
        return "fold"
    if isinstance(node, exp.AggFunc) or _func_name(node) in aggregates:
        return "other"
    return None


def _shown(node: exp.Func) -> str:
    text = node.sql(dialect="duckdb")
    return text if len(text) <= 60 else f"{_func_name(node)}(...)"


def _func_name(node: exp.Func) -> str:
    if isinstance(node, exp.Anonymous):
        return str(node.name).lower()
    return node.sql(dialect="duckdb").split("(", 1)[0].strip().lower()


def _inside(node: exp.Expr, clause: exp.Expr | None) -> bool:
    return clause is not None and any(p is clause for p in _parents(node))


def _parents(node: exp.Expr) -> list[exp.Expr]:
    out = []
    p = node.parent
    while p is not None:
        out.append(p)
        p = p.parent
    return out


def _int_literal(node: exp.Expr | None) -> int | None:
    if isinstance(node, exp.Literal) and not node.is_string and node.this.isdigit():
        return int(node.this)
    return None


def _is_aggregate(select: exp.Select) -> bool:
    """Grouped, or an aggregate in the projection or ORDER BY (which makes DuckDB aggregate
    the whole query into one row)."""
    if select.args.get("group") or select.args.get("having"):
        return True
    order = select.args.get("order")
    clauses = [*select.expressions, *(order.expressions if order is not None else [])]
    return any(type(n) in _FOLDS for e in clauses for n in e.walk())


def _output_names(select: exp.Select) -> dict[str, int]:
    """Projection names (alias or bare column) -> their position; a star makes them unknown."""
    names: dict[str, int] = {}
    for i, e in enumerate(select.expressions):
        if isinstance(e, exp.Alias | exp.Column) and not isinstance(e, exp.Star):
            names.setdefault(e.alias_or_name.lower(), i)
    return names


def _aliases(select: exp.Select) -> set[str]:
    """Names the projection gives to something other than the column of that name."""
    return {e.alias.lower() for e in select.expressions if isinstance(e, exp.Alias) and not (
        isinstance(e.this, exp.Column) and e.this.name.lower() == e.alias.lower())}


def _limits(select: exp.Select) -> tuple[int | None, int]:
    limit = select.args.get("limit")
    offset = select.args.get("offset")
    first = _int_literal(limit.expression) if limit is not None else None
    skip = _int_literal(offset.expression) if offset is not None else None
    return first, skip or 0


def _tail(order: list[str], limit: int | None, offset: int) -> str:
    sql = f" ORDER BY {', '.join(order)}" if order else ""
    if limit is not None:
        sql += f" LIMIT {limit}"
    if offset:
        sql += f" OFFSET {offset}"
    return sql


def _ordered(o: exp.Ordered, ref: str) -> str:
    """`ref` sorted as `o` sorts, NULL placement spelled out (DuckDB: NULLS LAST default)."""
    desc = " DESC" if o.args.get("desc") else ""
    nulls = " NULLS FIRST" if o.args.get("nulls_first") else " NULLS LAST"
    return f"{ref}{desc}{nulls}"


# -- plain rows ----------------------------------------------------------------------------


def _split_rows(select: exp.Select) -> Split:
    limit, offset = _limits(select)
    names = _output_names(select)
    has_star = any(isinstance(e, exp.Star) or isinstance(e, exp.Column) and isinstance(
        e.this, exp.Star) for e in select.expressions)
    partial = select.copy()
    order = select.args.get("order")
    keys: list[tuple[exp.Ordered, str]] = []  # (ordering, reference in the combine)
    hidden: list[str] = []
    if order is not None:
        for o in order.expressions:
            e = o.this
            pos = _int_literal(e)
            if pos is not None:
                keys.append((o, f"_c{pos - 1}"))
                continue
            if isinstance(e, exp.Column) and not e.table and e.name.lower() in names:
                if has_star:  # the star's columns come first: the position is not known
                    raise Unsplittable("ORDER BY an alias beside SELECT * is not split")
                keys.append((o, f"_c{names[e.name.lower()]}"))
                continue
            if any(not c.table and c.name.lower() in _aliases(select)
                   for c in e.find_all(exp.Column)):
                raise Unsplittable("an ORDER BY expression over a SELECT alias is not split")
            name = f"{_KEY}{len(hidden)}"
            hidden.append(name)
            partial.append("expressions", exp.alias_(e.copy(), name))
            keys.append((o, name))
    partial.set("limit", None)
    partial.set("offset", None)
    if limit is not None:  # each partition keeps its own first limit + offset rows
        partial.set("limit", exp.Limit(expression=exp.Literal.number(limit + offset)))
    else:
        partial.set("order", None)  # sorted once, in the combine

    def final(columns: list[str], types: list[str]) -> str | None:
        if not keys:
            return None
        refs = [_ordered(o, ref) for o, ref in keys]
        if any(ref.startswith("_c") and int(ref[2:]) >= len(columns) for _, ref in keys):
            raise Unsplittable("ORDER BY names a column position past the last column")
        return f"SELECT {', '.join(columns)} FROM {PARTS}" + _tail(refs, limit, offset)

    return Split(kind="rows", partial_tree=partial, hidden=tuple(hidden), final=final,
                 limit=limit, offset=offset)


# -- aggregates ----------------------------------------------------------------------------


class _Folder:
    """Turns expressions over groups and aggregates into expressions over the partials."""

    def __init__(self, group: list[exp.Expr]) -> None:
        self.group = group
        self.partial: list[exp.Expr] = []  # hidden aggregate columns of the partial query
        self._seen: dict[str, str] = {}

    def _column(self, agg: exp.Expr) -> str:
        key = agg.sql(dialect="duckdb")
        if key not in self._seen:
            self._seen[key] = f"{_AGG}{len(self.partial)}"
            self.partial.append(exp.alias_(agg, self._seen[key]))
        return self._seen[key]

    def fold(self, e: exp.Expr) -> exp.Expr:
        e = e.copy()
        return e.transform(self._node, copy=False)

    def _node(self, node: exp.Expr) -> exp.Expr:
        for i, g in enumerate(self.group):
            if node == g:
                return exp.column(f"{_KEY}{i}")
        inner, wrap = node, None
        if isinstance(node, exp.Filter) and type(node.this) in _FOLDS:
            inner, wrap = node.this, node.args.get("expression")
        if type(inner) not in _FOLDS:
            return node

        def part(agg: exp.Expr) -> exp.Expr:
            expr = exp.Filter(this=agg, expression=wrap.copy()) if wrap is not None else agg
            return exp.column(self._column(expr))

        kind = _FOLDS[type(inner)]
        arg = inner.this.copy()
        if kind == "avg":
            s = part(exp.Sum(this=arg))
            c = part(exp.Count(this=arg.copy()))
            return exp.Div(this=exp.Cast(this=exp.Sum(this=s), to=exp.DataType.build("DOUBLE")),
                           expression=exp.Sum(this=c))
        own = part(inner.copy())
        if kind in ("count", "sum"):
            return exp.Sum(this=own)
        return exp.Min(this=own) if kind == "min" else exp.Max(this=own)


def _split_aggregate(select: exp.Select) -> Split:
    limit, offset = _limits(select)
    names = _output_names(select)
    group_clause = select.args.get("group")
    group: list[exp.Expr] = []
    if group_clause is not None:
        for key in ("grouping_sets", "cube", "rollup", "totals", "all"):
            if group_clause.args.get(key):
                raise Unsplittable("GROUPING SETS, CUBE, ROLLUP and GROUP BY ALL are not split")
        for g in group_clause.expressions:
            if _int_literal(g) is not None or isinstance(g, exp.Literal):
                raise Unsplittable("GROUP BY a position is not split; name the expression")
            group.append(g)
    # The partial query drops the projection: a SELECT alias used in GROUP BY or WHERE would
    # no longer resolve there.
    aliases = _aliases(select)
    for clause in (*group, select.args.get("where")):
        if clause is not None and any(not c.table and c.name.lower() in aliases
                                      for c in clause.find_all(exp.Column)):
            raise Unsplittable("a SELECT alias used in GROUP BY or WHERE is not split; repeat "
                               "the expression")
    if any(isinstance(e, exp.Star) for e in select.expressions):
        raise Unsplittable("SELECT * with aggregates is not split")
    folder = _Folder(group)
    outputs = [folder.fold(e.this if isinstance(e, exp.Alias) else e)
               for e in select.expressions]
    having = select.args.get("having")
    having_sql = folder.fold(having.this) if having is not None else None
    order_refs: list[tuple[exp.Ordered, exp.Expr | str]] = []
    order = select.args.get("order")
    for o in order.expressions if order is not None else []:
        e = o.this
        pos = _int_literal(e)
        if pos is not None:
            order_refs.append((o, f"_c{pos - 1}"))
        elif isinstance(e, exp.Column) and not e.table and e.name.lower() in names:
            order_refs.append((o, f"_c{names[e.name.lower()]}"))
        else:
            order_refs.append((o, folder.fold(e)))
    for e in [*outputs, *([having_sql] if having_sql is not None else []),
              *[r for _, r in order_refs if isinstance(r, exp.Expr)]]:
        for f in e.find_all(exp.Anonymous):
            if str(f.name).lower() in REGISTRY:  # the combine has no store to compute them on
                raise Unsplittable(f"{f.name}() over GROUP BY keys is not split")
        for c in e.find_all(exp.Column):
            if not c.name.startswith((_KEY, _AGG)):
                raise Unsplittable(f"column {c.sql()!r} is outside the GROUP BY keys and the "
                                   "aggregates as written; not split")
    partial = exp.select(*[exp.alias_(g.copy(), f"{_KEY}{i}") for i, g in enumerate(group)],
                         *folder.partial)
    partial.set("from_", select.args["from_"].copy())
    if select.args.get("where") is not None:
        partial.set("where", select.args["where"].copy())
    if group:
        partial.set("group", exp.Group(expressions=[g.copy() for g in group]))
    hidden = tuple([f"{_KEY}{i}" for i in range(len(group))]
                   + [a.alias for a in folder.partial])

    def final(columns: list[str], types: list[str]) -> str:
        items = []
        for out, col, t in zip(outputs, columns, types, strict=True):
            sql = out.sql(dialect="duckdb")
            simple = "(" not in t and "[" not in t
            items.append(f"CAST({sql} AS {t}) AS {col}" if simple else f"{sql} AS {col}")
        sql = f"SELECT {', '.join(items)} FROM {PARTS}"
        if group:
            sql += " GROUP BY " + ", ".join(f"{_KEY}{i}" for i in range(len(group)))
        if having_sql is not None:
            sql += f" HAVING {having_sql.sql(dialect='duckdb')}"
        refs = [_ordered(o, r if isinstance(r, str) else f"({r.sql(dialect='duckdb')})")
                for o, r in order_refs]
        return sql + _tail(refs, limit, offset)

    return Split(kind="aggregate", partial_tree=partial, hidden=hidden, final=final,
                 limit=limit, offset=offset)


__all__ = ["PARTS", "Split", "Unsplittable", "split"]
