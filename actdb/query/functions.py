"""The registry of tensor functions: name -> signature, one-line doc, and implementation.

Each public function is a DuckDB macro (overloaded by arity where arguments are optional)
that calls an internal Arrow UDF `_actdb_<name>`; the macro fills defaults and passes a token
argument with its SQL type, so `' Paris'` and `42` (a token id) both work. A view is a UDF too:
it opens a handle and seals it again under the view's code (handles.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import aggregates, head_kernels, kernels, lens, neuron_kernels, stored_lens
from . import handles as H

# Argument kinds: a vec handle, a list of handles (`list(vec)`), a token (string or id), an
# integer, an anchor-set name, and a FLOAT[] direction (a literal, parameter or subquery).
VEC, VECS, TOKEN, INT, ANCHORS, DIRECTION = "vec", "vecs", "token", "int", "anchors", "direction"
# A token and the anchor set after it, handed to the UDF in one column (`token_sql`)
TOKEN_ANCHORS = "token+anchors"

NEAREST = "STRUCT(token_id BIGINT, token VARCHAR, cosine DOUBLE)[]"
TOP_LOGITS = "STRUCT(token_id BIGINT, token VARCHAR, logit DOUBLE)[]"
TOP_DIMS = "STRUCT(dim BIGINT, contribution DOUBLE)[]"


@dataclass(frozen=True, kw_only=True)
class Param:
    name: str
    kind: str  # vec, vecs, token, int, anchors, direction
    optional: bool = False
    missing: str = "0::BIGINT"  # an optional int's value when not given (0: the default)


@dataclass(frozen=True, kw_only=True)
class TensorFunction:
    name: str
    params: tuple[Param, ...]
    returns: str  # SQL type
    doc: str
    kernel: Callable[..., None] | None = None  # None for views (pure SQL)
    view: str | None = None
    # Each row is a product with a whole vocabulary (costly): its rows are computed as DuckDB
    # asks for them, never ahead of the query (bulk.py), where rows past the query's last
    # would cost as much as the rows it asked for.
    vocabulary_wide: bool = False

    @property
    def signature(self) -> str:
        req = [p.name for p in self.params if not p.optional]
        opt = [p.name for p in self.params if p.optional]
        args = ", ".join(req) + "".join(f" [, {o}]" for o in opt)
        return f"{self.name}({args}) -> {self.returns}"

    @property
    def arity(self) -> tuple[int, int]:
        return sum(not p.optional for p in self.params), len(self.params)

    def udf_name(self, session: str) -> str:
        """The internal UDF's name; DuckDB shares functions between the connections of one
        process to one file, so each connection registers its own under its session tag."""
        return f"_actdb_{self.name}_{session}"

    def udf_kinds(self) -> list[str]:
        """The kind of each of the internal UDF's parameters: the function's own, but for a
        token followed by an anchor set, which travel as one column (TOKEN_ANCHORS)."""
        kinds: list[str] = []
        for i, p in enumerate(self.params):
            if p.kind == ANCHORS and i and self.params[i - 1].kind == TOKEN:
                kinds[-1] = TOKEN_ANCHORS
            else:
                kinds.append(p.kind)
        return kinds

    def udf_params(self) -> list[str]:
        """SQL types of the internal UDF's parameters (a token is its SQL type and its text,
        with the anchor set after it if any, packed into one string: `token_sql`)."""
        return [{VEC: H.SQL_TYPE, VECS: f"{H.SQL_TYPE}[]", TOKEN: "VARCHAR", INT: "BIGINT",
                 ANCHORS: "VARCHAR", DIRECTION: "BIGINT", TOKEN_ANCHORS: "VARCHAR"}[k]
                for k in self.udf_kinds()]

    def macro_sql(self, session: str) -> str:
        """CREATE MACRO with one overload per accepted arity."""
        overloads = []
        lo, hi = self.arity
        for n in range(lo, hi + 1):
            names = [p.name for p in self.params[:n]]
            if self.view:  # a UDF that opens the handle and seals it with the view's code
                body = f"{self.udf_name(session)}({names[0]})"
            else:
                args = []
                for i, p in enumerate(self.params):
                    given = i < n
                    if p.kind == TOKEN:
                        args.append(token_sql(p.name))
                    elif p.kind == ANCHORS:
                        anchors = f"CAST({p.name} AS VARCHAR)" if given else "''"
                        if i and self.params[i - 1].kind == TOKEN:  # one column (udf_kinds)
                            args[-1] = token_sql(self.params[i - 1].name, anchors)
                        else:
                            args.append(anchors)
                    elif p.kind == DIRECTION:  # its id (aggregates.DirectionTable)
                        args.append(f"{direction_udf(session)}(CAST({p.name} AS FLOAT[]))")
                    elif p.kind == INT and not given:
                        args.append(p.missing)
                    else:
                        args.append(p.name)
                body = f"{self.udf_name(session)}({', '.join(args)})"
            overloads.append(f"({', '.join(names)}) AS {body}")
        return f"CREATE OR REPLACE TEMP MACRO {self.name}{', '.join(overloads)}"


def direction_udf(session: str) -> str:
    """The UDF that gives a FLOAT[] direction its id (aggregates.DirectionTable): a function
    of a direction gets the id, so the list is not copied into every row DuckDB hands it."""
    return f"_actdb_direction_{session}"


def token_sql(name: str, anchors: str | None = None) -> str:
    """The SQL that packs token argument `name` for its UDF: its SQL type (a token id or a
    token's text), kernels.TOKEN_SEP, the SQL of an anchor-set argument and TOKEN_SEP again
    where the function takes one after the token, then its text. DuckDB folds a constant
    token into one value, but hands an Arrow UDF every row of each string argument, so one
    column costs less to hand over than two or three (kernels.Arg.tokens unpacks it)."""
    sep = f"chr({ord(kernels.TOKEN_SEP)})"
    between = "" if anchors is None else f" || {anchors} || {sep}"
    return f"(typeof({name}) || {sep}{between} || CAST({name} AS VARCHAR))"


def _p(name: str, kind: str, optional: bool = False, missing: str = "0::BIGINT") -> Param:
    return Param(name=name, kind=kind, optional=optional, missing=missing)


_NO_POSITION = f"({head_kernels.NO_POSITION})::BIGINT"


V = _p("v", VEC)
FUNCTIONS: tuple[TensorFunction, ...] = (
    TensorFunction(
        name="cosine_to_anchor", params=(V, _p("token", TOKEN), _p("anchors", ANCHORS, True)),
        returns="DOUBLE", kernel=kernels.cosine_to_anchor,
        doc="cosine of v with the token's anchor; anchors: 'unembed' (default with an LM head), "
            "'embed' or 'unembed_folded'; NULL on inner, q_norm and k_norm sites",
    ),
    TensorFunction(
        name="nearest_anchors", params=(V, _p("k", INT), _p("anchors", ANCHORS, True)),
        returns=NEAREST, kernel=kernels.nearest_anchors,
        doc="the k anchors most similar to v: list of {token_id, token, cosine}; every row "
            "of the anchor matrix is ranked, rows past the tokenizer's vocabulary (padding) "
            "too, with a NULL token",
        vocabulary_wide=True,
    ),
    TensorFunction(
        name="dim_contribution", params=(V, _p("dim", INT)), returns="DOUBLE",
        kernel=kernels.dim_contribution, doc="v[dim] / ||v||: the signed share of one dimension",
    ),
    TensorFunction(
        name="top_dims", params=(V, _p("k", INT)), returns=TOP_DIMS, kernel=kernels.top_dims,
        doc="the k dims with the largest |v[dim]| / ||v||: list of {dim, contribution}",
    ),
    TensorFunction(
        name="anchor_contribution",
        params=(V, _p("dim", INT), _p("token", TOKEN), _p("anchors", ANCHORS, True)),
        returns="DOUBLE", kernel=kernels.anchor_contribution,
        doc="(v[dim] / ||v||) * anchor[dim]: summed over dims it is cosine_to_anchor(v, token)",
    ),
    TensorFunction(
        name="logit", params=(V, _p("token", TOKEN)), returns="DOUBLE", kernel=kernels.logit,
        doc="logit lens: the model's logit transform (scale, soft-cap; see models) of "
            "W_U[t] . final_norm(v) + b_U[t]; at the final site, the model's logit; NULL on "
            "inner, q_norm and k_norm sites",
    ),
    TensorFunction(
        name="logit_contribution", params=(V, _p("dim", INT), _p("token", TOKEN)),
        returns="DOUBLE", kernel=kernels.logit_contribution,
        doc="final_norm(v)[dim] * W_U[t, dim]; summed over dims it is the pre-transform logit "
            "minus b_U[t]: logit - b_U[t] without a scale or cap, else logit = "
            "cap * tanh(scale * (sum + b_U[t]) / cap)",
    ),
    TensorFunction(
        name="top_logits", params=(V, _p("k", INT)), returns=TOP_LOGITS,
        kernel=stored_lens.top_logits, doc="the k tokens with the largest logit: list of "
                                       "{token_id, token, logit} (logits as in logit()); "
                                       "every row of the LM head is ranked, as the model's "
                                       "logits hold them all: padding rows past the "
                                       "tokenizer's vocabulary have a NULL token; with k <= K "
                                       "read from the materialized lens (ingest --lens K)",
        vocabulary_wide=True,
    ),
    TensorFunction(
        name="uniform_angle", params=(V,), returns="DOUBLE", kernel=kernels.uniform_angle,
        doc="degrees between v and the all-ones vector",
    ),
    TensorFunction(
        name="rotation_angle", params=(V,), returns="DOUBLE", kernel=kernels.rotation_angle,
        doc="degrees between the site's input v and its output normed(v)",
    ),
    TensorFunction(
        name="vec_norm", params=(V,), returns="DOUBLE", kernel=kernels.vec_norm,
        doc="||v||, the Euclidean norm",
    ),
    TensorFunction(
        name="cosine", params=(_p("v1", VEC), _p("v2", VEC)), returns="DOUBLE",
        kernel=kernels.cosine, doc="cosine between two vectors of the same width",
    ),
    TensorFunction(
        name="angle", params=(_p("v1", VEC), _p("v2", VEC)), returns="DOUBLE",
        kernel=kernels.angle, doc="degrees between two vectors of the same width",
    ),
    TensorFunction(
        name="normalized", params=(V,), returns="vec", view="normalized",
        doc="view: z, the norm's output before gain and bias",
    ),
    TensorFunction(
        name="normed", params=(V,), returns="vec", view="normed",
        doc="view: y, the site's real output (gain and bias applied)",
    ),
    TensorFunction(
        name="final_norm", params=(V,), returns="vec", view="final_norm",
        doc="view: v passed through the model's final norm; every function of it is NULL on "
            "inner, q_norm and k_norm sites and on rows of another tower than the final "
            "norm's (an encoder's, a vision tower's) (the handle itself is not)",
    ),
    TensorFunction(
        name="to_list", params=(V,), returns="FLOAT[]", kernel=kernels.to_list,
        doc="the vector (with its view applied) as FLOAT[] for export",
    ),
    # The logit lens as a distribution. eps_t below is the float16 error of logit(v, t):
    # at most 2^-11 * sqrt(d) * ||gain * W_U[t]|| * scale (gain of the final norm; divided by
    # sin(uniform_angle(v)) for a LayerNorm), eps its largest value over the vocabulary. E is
    # the computation's error on each logit (query/vocab_scan.py derives it for the bfloat16
    # kernel; the float32 product's is smaller).
    TensorFunction(
        name="logprob", params=(V, _p("token", TOKEN)), returns="DOUBLE",
        kernel=stored_lens.logprob,
        doc="logit lens: log softmax of logit(v, .) over the vocabulary (the model's logit "
            "transforms applied) at the token, in nats; NULL on inner, q_norm and k_norm "
            "sites; error <= 2 eps + E, where eps = max over tokens t of eps_t = 2^-11 "
            "sqrt(d) ||gain * W_U[t]|| * logit scale (gain: the final norm's; divided by "
            "sin(uniform_angle(v)) at a LayerNorm), the float16 error of logit(v, t), and "
            "E = (2^-14 + (5d + 8) 2^-23) ||(final_norm(v), 1)|| max_t ||(W_U[t], b_U[t])|| + "
            "2^-16 the computation's (the 1 and b_U only with an LM-head bias; on a CPU with "
            "AVX-512 BF16 a bfloat16 product whose error is proven below it, elsewhere float32)"
            "; read from the materialized lens (ingest --lens K) for a token in its top K or "
            "the model's own prediction",
        vocabulary_wide=True,
    ),
    TensorFunction(
        name="prob", params=(V, _p("token", TOKEN)), returns="DOUBLE", kernel=stored_lens.prob,
        doc="logit lens: exp(logprob(v, token)), the token's probability; relative error "
            "<= exp(2 eps + E) - 1 (eps, E as in logprob)"
            "; read from the materialized lens as logprob is",
        vocabulary_wide=True,
    ),
    TensorFunction(
        name="token_rank", params=(V, _p("token", TOKEN)), returns="BIGINT",
        kernel=stored_lens.token_rank,
        doc="logit lens: 1 + the number of tokens with a larger logit (1: the top token; ties "
            "share the better rank); on a CPU with AVX-512 BF16 exact for the stored vector "
            "(logits compared in float64, a bfloat16 product deciding only the tokens farther "
            "from the token's logit than its proven error), elsewhere compared in float32 "
            "(tokens within E of it may count either way); against the model's own run, "
            "tokens within 2 eps of the token's logit may swap (eps, E as in logprob)"
            "; read from the materialized lens (ingest --lens K) for a token in its top K or "
            "the model's own prediction",
        vocabulary_wide=True,
    ),
    TensorFunction(
        name="entropy", params=(V,), returns="DOUBLE", kernel=stored_lens.entropy,
        doc="logit lens: entropy of the next-token distribution in nats; error <= eps * sd "
            "to first order (the stored vector's) + 2 E e^(2E) (sd + E) + 2^-16 (the "
            "computation's), sd the logits' standard deviation under the distribution (eps, "
            "E as in logprob)"
            "; read from the materialized lens (ingest --lens K) where stored",
        vocabulary_wide=True,
    ),
    TensorFunction(
        name="kl_to", params=(_p("v", VEC), _p("target", VEC)), returns="DOUBLE",
        kernel=lens.kl_to,
        doc="logit lens: KL(p_target || p_v) in nats, e.g. v a layer and target the final "
            "site of the same token; both of one model; error <= 2 eps_v + 2 eps_target * "
            "(1 + max |log p_target - log p_v|) to first order (the stored vectors') + 2 E_v "
            "+ (e^(2 E_target) - 1) D + 2 E_target e^(2 E_target) (the computation's), D = "
            "sum p_target |log p_target - log p_v| (eps, E as in logprob)",
    ),
    TensorFunction(
        name="logit_diff",
        params=(V, _p("token1", TOKEN), _p("token2", TOKEN)), returns="DOUBLE",
        kernel=lens.logit_diff,
        doc="logit(v, token1) - logit(v, token2) (the model's logit transforms applied); "
            "error <= eps_token1 + eps_token2 (eps_t as in logprob)",
    ),
    TensorFunction(
        name="delta", params=(V,), returns="FLOAT[]", kernel=lens.delta,
        doc="what the sublayer between this residual site (pre_attn, pre_cross or pre_mlp "
            "input) and the next stored one of its tower (pre_cross, pre_mlp, next pre_attn or "
            "final) wrote: x_next - x as FLOAT[]; "
            "NULL elsewhere (a parallel block, as GPT-NeoX's, norms both sublayers' input from "
            "one residual: its pre_attn delta is zero and its pre_mlp delta holds both "
            "sublayers' writes); float16 error: ||error|| <= (2^-11 + sqrt(d) 2^-25 + 2^-23) * "
            "(||x|| + ||x_next||)",
    ),
    # Aggregates through lists of handles, and a FLOAT[] direction.
    TensorFunction(
        name="mean_vector", params=(_p("vecs", VECS),), returns="FLOAT[]",
        kernel=aggregates.mean_vector,
        doc="the mean of a list of vectors, e.g. mean_vector(list(vec)) GROUP BY layer, as "
            "FLOAT[] (summed in float64); NULL entries are skipped; one width per list",
    ),
    TensorFunction(
        name="spectrum", params=(_p("vecs", VECS), _p("k", INT, True)), returns="DOUBLE[]",
        kernel=aggregates.spectrum,
        doc="eigenvalues of the covariance (divided by n - 1, float64) of a list of vectors, "
            "largest first; the first k (default all); NULL below 2 vectors",
    ),
    TensorFunction(
        name="cosine_to", params=(V, _p("direction", DIRECTION)), returns="DOUBLE",
        kernel=aggregates.cosine_to,
        doc="cosine of v with a FLOAT[] direction (literal, parameter or subquery, e.g. the "
            "difference of two mean_vector()s); NULL if either is zero",
    ),
    TensorFunction(
        name="project", params=(V, _p("direction", DIRECTION)), returns="DOUBLE",
        kernel=aggregates.project,
        doc="v . direction / ||direction||: the length of v along a FLOAT[] direction",
    ),
    # Activations read through a head's stored weights (head_kernels.py).
    TensorFunction(
        name="head_write", params=(V, _p("layer", INT), _p("head", INT)), returns="FLOAT[]",
        kernel=head_kernels.head_write,
        doc="what head `head` of `layer` writes to the residual stream through its OV circuit "
            "for a query attending with weight 1 to v: (W_V y + b_V) W_O, y = normed(v), v a "
            "row of the site the attention reads (its pre-attention norm); grouped-query heads "
            "read their shared W_V; the value bias b_V is included, the output bias b_O (added "
            "once for all heads) is not; float16 error: ||error|| <= 2^-9 sqrt(d) sigma_1 "
            "(the head's top OV singular value, circuits), divided by sin(uniform_angle(v)) at "
            "a LayerNorm",
    ),
    TensorFunction(
        name="qk_score",
        params=(_p("v_query", VEC), _p("v_key", VEC), _p("layer", INT), _p("head", INT),
                _p("q_pos", INT, True, _NO_POSITION), _p("k_pos", INT, True, _NO_POSITION)),
        returns="DOUBLE", kernel=head_kernels.qk_score,
        doc="the attention logit of head `head` of `layer` for a query row and a key row (rows "
            "of the site the attention reads): scale * q . k, q = W_Q y_q + b_Q, k = W_K y_k + "
            "b_K, y = normed(v), scale the model's own (its attention's `scaling`, usually "
            "d_head^-0.5), before the causal mask and any ALiBi bias; for a rotary model q and "
            "k are turned to positions q_pos and k_pos (the rows' `position`) as the model does, "
            "and without them the score is NULL, since it depends on the positions; an error "
            "where queries and keys are normed per head (q_norm, k_norm); float16 error: "
            "|error| <= 2^-9 sqrt(d) scale (||W_Q,h diag(g)||_2 ||k|| + ||W_K,h diag(g)||_2 "
            "||q||), g the norm's gain, divided by sin(uniform_angle) at a LayerNorm",
    ),
)

# Activations read through an MLP's stored neurons (neuron_kernels.py). eps_n below is the
# float16 error of the neuron's pre-activation: the stored direction's rounding (2^-11 per
# element) carried through the norm's output y and the neuron's row.
_NEURON_V = ("v: a row of the site whose output the MLP reads (its pre-MLP norm; post_attn in a "
             "post-norm block as BERT's), a vec or normed(vec); any other row is an error; a "
             "mixture of experts is an error (read its experts through neurons)")
_EPS_N = ("eps_n = 2^-10 sqrt(d) ||g * W[n]|| (W the row the activation reads, g the norm's "
          "gain), divided by sin(uniform_angle(v)) at a LayerNorm")


def _neuron_functions() -> tuple[TensorFunction, ...]:
    return (
        TensorFunction(
            name="neuron_pre", params=(V, _p("neuron", INT)), returns="DOUBLE",
            kernel=neuron_kernels.neuron_pre,
            doc="the neuron's pre-activation, the input of the MLP's activation: W_gate[n] . y "
                "+ b_gate[n] in a gated MLP, W_in[n] . y + b_in[n] otherwise, y = normed(v) "
                f"(gain * z + bias, as the model computes it); {_NEURON_V}; float16 error: "
                f"|error| <= eps_n, {_EPS_N}",
        ),
        TensorFunction(
            name="neuron_act", params=(V, _p("neuron", INT)), returns="DOUBLE",
            kernel=neuron_kernels.neuron_act,
            doc="the value that multiplies the neuron's W_out row: act(neuron_pre(v, n)), times "
                "the up projection W_in[n] . y + b_in[n] in a gated MLP; act is the formula "
                "found at ingest by calling the model's own activation module; float16 error: "
                "|error| <= L eps_n (ungated), L eps_g |up| + |act(pre)| eps_up + L eps_g eps_up "
                "(gated: eps_g and eps_up the eps_n of the W_gate and W_in rows), L the largest "
                f"slope of act near pre (1 ReLU, 1.13 GELU, 1.1 SiLU), {_EPS_N}; {_NEURON_V}",
        ),
        TensorFunction(
            name="active_fraction", params=(V,), returns="DOUBLE",
            kernel=neuron_kernels.active_fraction,
            doc="the share of the layer's neurons with act(neuron_pre) > 0: for ReLU exactly "
                "those with a non-zero activation, for a smooth activation (GELU, SiLU) those "
                "past its zero (a positive pre-activation), whatever a gate's up projection "
                "does; exact but for neurons with |neuron_pre| <= eps_n, which may count "
                f"either way; {_NEURON_V}",
        ),
    )


FUNCTIONS = (*FUNCTIONS, *_neuron_functions())

REGISTRY: dict[str, TensorFunction] = {f.name: f for f in FUNCTIONS}


def describe() -> list[dict[str, Any]]:
    """Rows for `actdb functions`: name, signature, doc."""
    return [{"name": f.name, "signature": f.signature, "doc": f.doc} for f in FUNCTIONS]
