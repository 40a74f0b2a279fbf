"""The catalog's schema: its tables as a new store's catalog is created, the columns and
tables later versions added (given to an older store when it is next written), and which
columns a store has (an older store's records keep their defaults for the others)."""

from __future__ import annotations

from collections.abc import Sequence

from . import digests
from .catalog_connection import CatalogConnection
from .records import ModelRecord, SiteRecord

# The format new stores are created with, local or on object storage: 5, the catalog records
# each chunk's digest under its place (digests.py). Versions 2 (local), 3 (object storage) and
# 4 (a store holding an image model) are upgraded to it by the first writer that opens them
# (upgrade.py); FORMAT.md.
LOCAL_FORMAT_VERSION = digests.DIGESTS_VERSION
# A model without a token embedding, or whose head is a classifier (an image model): an actdb
# reading version 3 or less would call its missing embedding damage and its labels tokens.
IMAGE_FORMAT_VERSION = 4
# A model whose sites see different grids of positions (sites.grid, tokens.grid), or an
# encoder-decoder, whose rows each belong to one tower (tokens.tower, prompt_runs.tower): an
# actdb reading version 5 or less would give every site every grid's and tower's rows.
GRID_FORMAT_VERSION = 6
# A model that stores the materialized lens (models.lens_k, lens_layout.py): an actdb reading
# version 6 or less would not know its arrays, and would not verify them.
LENS_FORMAT_VERSION = 7
# The newest format this actdb reads and writes (a store is raised to it by the model that
# needs it, `version_needed`).
FORMAT_VERSION = LENS_FORMAT_VERSION


def version_needed(model: ModelRecord, sites: Sequence[SiteRecord] = ()) -> int:
    """The format version a store must have to hold `model` and its `sites` (0: any)."""
    if model.lens_k:
        return LENS_FORMAT_VERSION
    if model.row_towers or any(s.grid is not None for s in sites):
        return GRID_FORMAT_VERSION
    if model.has_embed is False or model.head_kind not in (None, "lm"):
        return IMAGE_FORMAT_VERSION
    return 0

SCHEMA = """
CREATE TABLE meta (key VARCHAR, value VARCHAR);
CREATE TABLE models (
    model VARCHAR, model_id INTEGER, source VARCHAR, revision VARCHAR, architecture VARCHAR,
    d_model INTEGER, n_layers INTEGER, vocab_size INTEGER, n_sites INTEGER,
    has_lm_head BOOLEAN, has_lm_head_bias BOOLEAN, tied_embeddings BOOLEAN, final_site VARCHAR,
    dtype VARCHAR, max_length INTEGER, sites_glob VARCHAR, chunk_tokens INTEGER,
    n_rows BIGINT, logit_softcap DOUBLE, config JSON, created_at TIMESTAMP DEFAULT now(),
    logit_scale DOUBLE, logit_max_rel_error DOUBLE, params_digest VARCHAR, has_embed BOOLEAN,
    head_kind VARCHAR, head_position INTEGER, towers JSON, lens_k INTEGER, head_pool VARCHAR,
    head_note VARCHAR
);
CREATE TABLE prompts (prompt_id BIGINT, text VARCHAR, n_tokens INTEGER);
CREATE TABLE prompt_runs (
    model VARCHAR, prompt_id BIGINT, row_start BIGINT, n_tokens INTEGER, truncated BOOLEAN,
    tower VARCHAR
);
CREATE TABLE tokens (
    model VARCHAR, prompt_id BIGINT, position INTEGER, token_id INTEGER, token VARCHAR,
    "row" BIGINT, patch_row INTEGER, patch_col INTEGER, frame INTEGER, grid INTEGER,
    tower VARCHAR
);
CREATE TABLE sites (
    model VARCHAR, site VARCHAR, site_id INTEGER, layer INTEGER, role VARCHAR, kind VARCHAR,
    d INTEGER, n_heads INTEGER, eps DOUBLE, module VARCHAR, has_gain BOOLEAN, has_bias BOOLEAN,
    max_rel_error DOUBLE, centered BOOLEAN, tower VARCHAR, layout VARCHAR, grid INTEGER
);
CREATE TABLE vocab (model VARCHAR, token_id INTEGER, token VARCHAR, piece VARCHAR);
""" + digests.SCHEMA + ";\n"

# Columns format version 2 added (and params_digest, later): a store without them being
# written gets them (NULL in its old rows, which then keep reading by kind, as version 1 did,
# and resume without the digest's check).
_ADDED_COLUMNS = {"models": {"logit_scale": "DOUBLE", "logit_max_rel_error": "DOUBLE",
                             "params_digest": "VARCHAR", "has_embed": "BOOLEAN",
                             "head_kind": "VARCHAR", "head_position": "INTEGER",
                             "towers": "JSON", "lens_k": "INTEGER", "head_pool": "VARCHAR",
                             "head_note": "VARCHAR"},
                  "sites": {"centered": "BOOLEAN", "tower": "VARCHAR", "layout": "VARCHAR",
                            "grid": "INTEGER"},
                  "tokens": {"patch_row": "INTEGER", "patch_col": "INTEGER", "frame": "INTEGER",
                             "grid": "INTEGER", "tower": "VARCHAR"},
                  "prompt_runs": {"tower": "VARCHAR"}}
TABLES = ("meta", "models", "prompts", "prompt_runs", "tokens", "sites", "vocab", digests.TABLE)


class CatalogSchema:
    """The tables and columns of the catalog on `connection`."""

    def __init__(self, connection: CatalogConnection) -> None:
        self.connection = connection
        self._columns: dict[str, set[str]] = {}
        self._complete = False  # every added table and column is there

    def create(self, version: int) -> None:
        """The tables of a new catalog, and its format `version` (inside a transaction)."""
        con = self.connection.con
        con.execute(SCHEMA)
        con.execute("INSERT INTO meta VALUES ('format_version', ?), ('created_by', 'actdb')",
                    [str(version)])

    def columns(self, table: str, wanted: list[str]) -> list[str]:
        """The wanted columns the table has: a version-1 store lacks the later ones, which
        then keep their record defaults. Cached: information_schema is slow to query, and the
        columns of models and sites never change after creation."""
        if table not in self._columns:
            assert table in TABLES, table
            with self.connection.session() as con:
                res = con.execute(f"SELECT * FROM {table} LIMIT 0")  # table is one of ours
                self._columns[table] = {r[0] for r in res.description or []}
                res.fetchall()  # an unfinished result would block the connection
        return [c for c in wanted if c in self._columns[table]]

    def add_missing(self) -> None:
        """Give a store written by an older actdb the tables and columns since added."""
        if self._complete:
            return
        with self.connection.session() as con:
            if not con.execute("SELECT 1 FROM duckdb_tables() WHERE table_name = ? AND "
                               "database_name = current_database()",
                               [digests.TABLE]).fetchall():
                con.execute(digests.SCHEMA)
                self.connection.mark_changed()
        for table, cols in _ADDED_COLUMNS.items():
            have = self.columns(table, list(cols))
            for name, sqltype in cols.items():
                if name not in have:
                    with self.connection.session() as con:
                        con.execute(f"ALTER TABLE {table} ADD COLUMN {name} {sqltype}")
                        self.connection.mark_changed()
                    self._columns.clear()
        self._complete = True


__all__ = ["FORMAT_VERSION", "GRID_FORMAT_VERSION", "IMAGE_FORMAT_VERSION", "LENS_FORMAT_VERSION",
           "LOCAL_FORMAT_VERSION", "SCHEMA", "TABLES", "CatalogSchema", "version_needed"]
