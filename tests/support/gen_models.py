"""Tiny random decoder models built by combining architectural choices, for the generative
faithfulness test.

Each model is a `PreTrainedModel` with its own config class. Its norm modules are one class
whose *name* says nothing reliable (it ends in RMSNorm or LayerNorm at random, whatever it
computes), whose parameters have unusual names (`scale`, `shift`), and whose affine is drawn:
none, gain, `1 + gain`, bias only, or gain and bias. The model records, for every norm module it
builds, the role the norm plays and the layout its input has, so a test can check actdb's
findings against what was built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

D, HEADS, LAYERS, FFN, LATENT = 32, 4, 2, 48, 16
AFFINES = ("none", "gain", "gain1p", "bias", "gain_bias", "gain1p_bias")
MODES = ("pre", "post", "sandwich", "post_sub")
QK = (None, "btd", "bthd", "bhtd", "list")
LOGITS = ("none", "scale", "divide", "softcap", "scale_softcap", "pre_divide")


@dataclass(frozen=True, kw_only=True)
class Choices:
    mode: str = "pre"  # pre-norm, post-norm (after the residual add), sandwich, post-sublayer
    qk: str | None = None  # q/k norm layout
    latent: bool = False  # a low-rank query with a norm on its latent (DeepSeek-V2)
    sub_norm: bool = False  # a norm on the attention output before o_proj
    ffn_norm: bool = False  # a norm inside the MLP, before down_proj
    embed_norm: bool = False  # a norm right after the embedding (BLOOM)
    centered: tuple[bool, ...] = (True, False)  # drawn from, per module
    affines: tuple[str, ...] = AFFINES  # drawn from, per module
    head_bias: bool = False
    tied: bool = False
    logits: str = "none"
    keeps: bool = True  # forward takes logits_to_keep
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def sample_choices(n: int, seed: int) -> list[Choices]:
    """`n` combinations drawn with a seeded generator; every value of each axis appears."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        out.append(Choices(
            mode=MODES[i % len(MODES)],
            qk=QK[(i // 2) % len(QK)] if i % 3 else QK[int(rng.integers(len(QK)))],
            latent=bool(rng.integers(2)),
            sub_norm=bool(rng.integers(2)),
            ffn_norm=bool(rng.integers(2)),
            embed_norm=bool(rng.integers(4) == 0),
            centered=((True,), (False,), (True, False))[i % 3],
            affines=(AFFINES[i % len(AFFINES)], AFFINES[int(rng.integers(len(AFFINES)))]),
            head_bias=bool(rng.integers(2)),
            tied=bool(rng.integers(2)),
            logits=LOGITS[i % len(LOGITS)],
            keeps=bool(rng.integers(2)),
            seed=seed * 1000 + i,
        ))
    return out


class GenConfig(PretrainedConfig):
    model_type = "actdb_generated"

    def __init__(self, vocab_size: int = 400, hidden_size: int = D, logit_scale: float = 1.0,
                 logit_softcap: float = 0.0, **kwargs: Any) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.logit_scale = logit_scale
        self.logit_softcap = logit_softcap
        super().__init__(**kwargs)


class _Norm(nn.Module):
    """y = affine(normalize(x)); parameter names and the class name hide what it does."""

    def __init__(self, d: int, *, centered: bool, affine: str, eps: float,
                 gen: torch.Generator) -> None:
        super().__init__()
        self.centered, self.affine, self.epsilon = centered, affine, eps
        if affine.startswith("gain"):
            noise = 0.3 * torch.randn(d, generator=gen)
            self.scale = nn.Parameter(noise if affine.startswith("gain1p") else 1.0 + noise)
        if affine.endswith("bias"):
            self.shift = nn.Parameter(0.2 * torch.randn(d, generator=gen))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x - x.mean(-1, keepdim=True) if self.centered else x
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.epsilon)
        if self.affine.startswith("gain1p"):
            h = h * (1.0 + self.scale)
        elif self.affine.startswith("gain"):
            h = h * self.scale
        if self.affine.endswith("bias"):
            h = h + self.shift
        return h


class GenRMSNorm(_Norm):
    pass


class GenLayerNorm(_Norm):
    pass


class _Factory:
    """Draws each norm's formula and records its role and layout under its module path."""

    def __init__(self, c: Choices) -> None:
        self.c = c
        self.gen = torch.Generator().manual_seed(c.seed)
        self.rng = np.random.default_rng(c.seed)
        self.roles: dict[str, str] = {}
        self.layouts: dict[str, str] = {}

    def norm(self, d: int, path: str, role: str, layout: str = "btd") -> nn.Module:
        self.roles[path], self.layouts[path] = role, layout
        centered = bool(self.rng.choice(self.c.centered))
        affine = str(self.rng.choice(self.c.affines))
        eps = float(self.rng.choice([1e-5, 1e-6, 1e-3]))
        cls = GenRMSNorm if self.rng.integers(2) else GenLayerNorm
        return cls(d, centered=centered, affine=affine, eps=eps, gen=self.gen)

    def heads(self, path: str, role: str) -> nn.Module:
        self.roles[path], self.layouts[path] = role, "list"
        mods = [self.norm(D // HEADS, f"{path}.{i}", role) for i in range(HEADS)]
        for i in range(HEADS):
            del self.roles[f"{path}.{i}"], self.layouts[f"{path}.{i}"]
        first = mods[0]
        for m in mods[1:]:  # one formula for the site; gains and biases differ per head
            m.centered, m.epsilon = first.centered, first.epsilon  # type: ignore[assignment]
        return nn.ModuleList(mods)


class GenAttention(nn.Module):
    def __init__(self, c: Choices, f: _Factory, p: str) -> None:
        super().__init__()
        self.c, dh = c, D // HEADS
        if c.latent:
            self.q_a = nn.Linear(D, LATENT)
            self.q_a_norm = f.norm(LATENT, f"{p}.q_a_norm", "inner")
            self.q_b = nn.Linear(LATENT, D)
        else:
            self.q_proj = nn.Linear(D, D)
        self.k_proj, self.v_proj, self.o_proj = (nn.Linear(D, D) for _ in range(3))
        if c.qk == "btd":
            self.q_norm = f.norm(D, f"{p}.q_norm", "q_norm")
            self.k_norm = f.norm(D, f"{p}.k_norm", "k_norm")
        elif c.qk in ("bthd", "bhtd"):
            self.q_norm = f.norm(dh, f"{p}.q_norm", "q_norm", c.qk)
            self.k_norm = f.norm(dh, f"{p}.k_norm", "k_norm", c.qk)
        elif c.qk == "list":
            self.q_norm = f.heads(f"{p}.q_norm", "q_norm")
            self.k_norm = f.heads(f"{p}.k_norm", "k_norm")
        if c.sub_norm:
            self.sub_norm = f.norm(D, f"{p}.sub_norm", "inner")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        dh = D // HEADS
        q = self.q_b(self.q_a_norm(self.q_a(x))) if self.c.latent else self.q_proj(x)
        k, v = self.k_proj(x), self.v_proj(x)
        if self.c.qk == "btd":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (z.view(b, t, HEADS, dh) for z in (q, k, v))
        if self.c.qk == "bthd":
            q, k = self.q_norm(q), self.k_norm(k)
        elif self.c.qk == "list":
            q = torch.stack([n(q[:, :, i]) for i, n in enumerate(self.q_norm)], dim=2)
            k = torch.stack([n(k[:, :, i]) for i, n in enumerate(self.k_norm)], dim=2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))  # [B, H, T, dh]
        if self.c.qk == "bhtd":
            q, k = self.q_norm(q), self.k_norm(k)
        att = q @ k.transpose(-1, -2) / math.sqrt(dh)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~causal, float("-inf")).softmax(-1)
        out = (att @ v).transpose(1, 2).reshape(b, t, D)
        if self.c.sub_norm:
            out = self.sub_norm(out)
        return self.o_proj(out)


class GenMLP(nn.Module):
    def __init__(self, c: Choices, f: _Factory, p: str) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(D, FFN), nn.Linear(FFN, D)
        self.ffn_norm = f.norm(FFN, f"{p}.ffn_norm", "inner") if c.ffn_norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.up(x))
        return self.down(self.ffn_norm(h) if self.ffn_norm is not None else h)


class GenBlock(nn.Module):
    def __init__(self, c: Choices, f: _Factory, p: str) -> None:
        super().__init__()
        self.mode = c.mode
        if c.mode in ("pre", "sandwich"):
            self.ln1 = f.norm(D, f"{p}.ln1", "pre_attn")
        self.self_attn = GenAttention(c, f, f"{p}.self_attn")
        if c.mode == "post":  # post-LN: the norm of the residual sum, carried on (as BERT's)
            self.ln1 = f.norm(D, f"{p}.ln1", "post_attn")
        if c.mode in ("sandwich", "post_sub"):
            self.post_attn_norm = f.norm(D, f"{p}.post_attn_norm", "post_attn")
        if c.mode in ("pre", "sandwich"):
            self.ln2 = f.norm(D, f"{p}.ln2", "pre_mlp")
        self.mlp = GenMLP(c, f, f"{p}.mlp")
        if c.mode == "post":
            self.ln2 = f.norm(D, f"{p}.ln2", "post_mlp")
        if c.mode in ("sandwich", "post_sub"):
            self.post_mlp_norm = f.norm(D, f"{p}.post_mlp_norm", "post_mlp")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "pre":
            h = x + self.self_attn(self.ln1(x))
            return h + self.mlp(self.ln2(h))
        if self.mode == "post":
            h = self.ln1(x + self.self_attn(x))
            return self.ln2(h + self.mlp(h))
        if self.mode == "sandwich":
            h = x + self.post_attn_norm(self.self_attn(self.ln1(x)))
            return h + self.post_mlp_norm(self.mlp(self.ln2(h)))
        h = x + self.post_attn_norm(self.self_attn(x))
        return h + self.post_mlp_norm(self.mlp(h))


class GenModel(nn.Module):
    def __init__(self, config: GenConfig, c: Choices, f: _Factory) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, D)
        self.embed_norm = f.norm(D, "model.embed_norm", "embed") if c.embed_norm else None
        self.layers = nn.ModuleList(GenBlock(c, f, f"model.layers.{i}") for i in range(LAYERS))
        self.norm = f.norm(D, "model.norm", "final")

    def forward(self, input_ids: torch.Tensor, attention_mask: Any = None,
                **kwargs: Any) -> torch.Tensor:
        # Causal attention and right padding: real tokens never see the padding.
        h = self.embed_tokens(input_ids)
        if self.embed_norm is not None:
            h = self.embed_norm(h)
        for layer in self.layers:
            h = layer(h)
        return self.norm(h)


class GenForCausalLM(PreTrainedModel):
    config_class = GenConfig
    base_model_prefix = "model"

    def __init__(self, config: GenConfig, choices: Choices) -> None:
        super().__init__(config)
        torch.manual_seed(choices.seed)
        f = _Factory(choices)
        self.choices = choices
        self.model = GenModel(config, choices, f)
        self.lm_head = nn.Linear(D, config.vocab_size, bias=choices.head_bias)
        if choices.head_bias:
            with torch.no_grad():
                self.lm_head.bias.normal_(0.0, 0.5)
        if choices.tied:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.roles, self.layouts = f.roles, f.layouts
        self.pre_divide = config.hidden_size / 4.0 if choices.logits == "pre_divide" else None

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        if self.pre_divide is not None:  # MiniCPM: the hidden state is divided before the head
            h = h / self.pre_divide
        logits = self.lm_head(h)
        c = self.choices.logits
        if c == "scale":
            logits = logits * self.config.logit_scale  # Cohere
        elif c == "divide":
            logits = logits / self.config.logit_scale  # Granite
        elif c == "scale_softcap":
            logits = logits * self.config.logit_scale
        if c in ("softcap", "scale_softcap"):  # Gemma 2
            cap = self.config.logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits

    def forward(self, input_ids: torch.Tensor, attention_mask: Any = None,
                **kwargs: Any) -> CausalLMOutput:
        h = self.model(input_ids, attention_mask)
        keep = kwargs.get("logits_to_keep", 0) if self.choices.keeps else 0
        if isinstance(keep, torch.Tensor):
            h = h[:, keep]
        elif keep:
            h = h[:, -keep:]
        return CausalLMOutput(logits=self._logits(h))


class GenForCausalLMKeeps(GenForCausalLM):
    """The same model, with `logits_to_keep` in its signature (as transformers' models have)."""

    def forward(self, input_ids: torch.Tensor, attention_mask: Any = None,  # type: ignore[override]
                logits_to_keep: int | torch.Tensor = 0, **kwargs: Any) -> CausalLMOutput:
        return super().forward(input_ids, attention_mask, logits_to_keep=logits_to_keep)


def build(c: Choices, vocab_size: int) -> GenForCausalLM:
    if c.logits == "pre_divide" and c.head_bias:
        # W (h / k) + b is no scale of W h + b: MiniCPM, which divides first, has no head bias.
        c = Choices(**{**c.__dict__, "head_bias": False})
    rng = np.random.default_rng(c.seed + 17)
    config = GenConfig(vocab_size=vocab_size, logit_scale=float(rng.uniform(0.05, 8.0)),
                       logit_softcap=float(rng.uniform(2.0, 30.0)))
    cls = GenForCausalLMKeeps if c.keeps else GenForCausalLM
    return cls(config, c).float().eval()
