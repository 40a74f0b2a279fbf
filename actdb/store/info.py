"""What a store holds: models, prompts, sites with their faithfulness, bytes on disk."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .layer_weights import read_manifest
from .store import Store


@dataclass(frozen=True, kw_only=True)
class StoreInfo:
    path: str
    format_version: int
    models: list[dict[str, Any]]
    sites: list[dict[str, Any]]
    n_prompts: int
    bytes_on_disk: dict[str, int]


def describe(store: Store) -> StoreInfo:
    con = store.catalog.con
    # Version-1 stores have no logit transform columns: they read as NULL.
    have = {r[0] for r in con.execute(
        "SELECT column_name FROM information_schema.columns WHERE table_name = 'models'"
    ).fetchall()}
    logit_cols = ", ".join(
        f"m.{c}" if c in have else f"NULL::DOUBLE AS {c}"
        for c in ("logit_scale", "logit_softcap", "logit_max_rel_error")
    ) + (", m.head_kind" if "head_kind" in have else ", NULL::VARCHAR AS head_kind") + (
        ", m.head_position" if "head_position" in have else ", NULL::INTEGER AS head_position"
    ) + (", m.lens_k" if "lens_k" in have else ", NULL::INTEGER AS lens_k") + "".join(
        f", m.{c}" if c in have else f", NULL::VARCHAR AS {c}"
        for c in ("head_pool", "head_note"))
    models = con.execute(
        "SELECT m.model, m.model_id, m.architecture, m.d_model, m.n_layers, m.vocab_size, "
        "m.n_sites, "
        "m.has_lm_head, (SELECT count(DISTINCT r.prompt_id) FROM prompt_runs r "
        "WHERE r.model = m.model) AS prompts, "
        # not n_rows: a merged sharded ingest leaves rows between shards unused
        "(SELECT count(*) FROM tokens t WHERE t.model = m.model) AS tokens, "
        f"m.dtype, m.source, {logit_cols} FROM models m ORDER BY m.model_id"
    ).fetchdf().to_dict("records")
    sites = con.execute(
        "SELECT model, site, layer, role, kind, d, n_heads, module, max_rel_error "
        "FROM sites JOIN models USING (model) ORDER BY model_id, site_id"
    ).fetchdf().to_dict("records")
    for m in models:
        m["weights"] = _weights_summary(read_manifest(store.arrays, int(m["model_id"])))
    n_prompts = (store.catalog.one("SELECT count(*) FROM prompts") or (0,))[0]
    return StoreInfo(
        path=store.location, format_version=store.catalog.format_version(), models=models,
        sites=sites, n_prompts=int(n_prompts), bytes_on_disk=store.disk_bytes(),
    )


def _weights_summary(manifest: dict[str, Any] | None) -> dict[str, Any] | None:
    """Bytes and layers of a model's stored layer weights (None: none stored)."""
    if manifest is None:
        return None
    layers = manifest.get("layers", [])
    return {"bytes": int(manifest.get("bytes", 0)),
            "attention_layers": sum(1 for x in layers if x.get("attn")),
            "mlp_layers": sum(1 for x in layers if x.get("mlp")),
            "refused": list(manifest.get("refused", []))}
