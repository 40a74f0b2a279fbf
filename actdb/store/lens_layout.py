"""The materialized lens's place in a store: which sites carry it and its arrays' shapes.

A model ingested with `lens=K` (models.lens_k) stores, beside each lens site's direction, norm
and mean, the logit lens of every row, computed at ingest from the stored fields through the
model's recorded logit transform (docs/FORMAT.md, "Materialized lens"):

    lens_ids     int32   [rows, K + 1]  the top K token ids (logit descending, ties lower id
                                        first), then the model's own prediction at that row
                                        (the final site's top token)
    lens_logits  float32 [rows, K + 1]  their logits, in the same order
    lens_stats   float32 [rows, 3]      log-sum-exp of the logits over the vocabulary, the
                                        entropy of their softmax (nats), the prediction's rank
                                        (1 + the tokens with a strictly larger logit)

One place for the fact, read by the ingest that writes the arrays, the store that sizes and
verifies them and the query that reads them.
"""

from __future__ import annotations

from collections.abc import Sequence

from .records import ModelRecord, SiteRecord

LENS_FIELDS = ("lens_ids", "lens_logits", "lens_stats")
LSE, ENTROPY, PRED_RANK = 0, 1, 2  # the columns of lens_stats
N_STATS = 3
# Roles whose rows never meet the LM head (the lens functions give NULL there).
OFF_LENS_ROLES = frozenset({"inner", "q_norm", "k_norm"})


def is_lens_site(model: ModelRecord, site: SiteRecord) -> bool:
    """Whether `site` of `model` carries the materialized lens: the model stores one, over an
    LM head, and the site is one the lens functions read (a model-width vector per row)."""
    return (bool(model.lens_k) and model.head_kind in (None, "lm") and model.has_lm_head
            and not model.row_towers and is_lens_role(site) and site.d == model.d_model)


def is_lens_role(site: SiteRecord) -> bool:
    """Whether the lens functions read `site`: a residual-width vector per row (its width is
    checked against the head's where the model is known)."""
    return site.role not in OFF_LENS_ROLES and site.n_heads is None and site.grid is None


def lens_shapes(k: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """Each lens array's shape past the row axis, and its dtype."""
    return {"lens_ids": ((k + 1,), "int32"), "lens_logits": ((k + 1,), "float32"),
            "lens_stats": ((N_STATS,), "float32")}


def lens_sites(model: ModelRecord, sites: Sequence[SiteRecord]) -> list[SiteRecord]:
    return [s for s in sites if is_lens_site(model, s)]


__all__ = ["ENTROPY", "LENS_FIELDS", "LSE", "N_STATS", "OFF_LENS_ROLES", "PRED_RANK",
           "is_lens_role", "is_lens_site", "lens_shapes", "lens_sites"]
