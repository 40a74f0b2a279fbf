"""Tiny vision, video and multimodal models of the families `transformers` ships, built from
configs for the survey (tests/support/vision_scan.py) and the tests: the common small sizes,
and, per family, the sizes its config needs beside them (a survey config's, not actdb's)."""

from __future__ import annotations

from typing import Any

# Sizes a tiny model of most families accepts; hierarchical ones read their own names.
SIZES: dict[str, Any] = dict(
    image_size=32, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
    num_attention_heads=2, intermediate_size=64, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
    hidden_sizes=[16, 32], num_labels=3, window_size=2, embed_dims=[16, 32],
    num_encoder_blocks=2, sr_ratios=[2, 1], mlp_ratios=[2, 2], num_stages=2, dims=[16, 32])

# What a family's config needs beside SIZES (or instead of them) to build tiny and run on
# 32 x 32 images.
OVERRIDES: dict[str, dict[str, Any]] = {}


def config_for(model_type: str) -> Any:
    """The family's config at the survey's sizes."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    sizes = {**SIZES, **OVERRIDES.get(model_type, {})}
    for k, v in sizes.items():
        if hasattr(config, k):
            setattr(config, k, v)
    return config


def image_processor(size: int = 32) -> Any:
    """A plain image processor: resize to `size` x `size`, rescale, normalize."""
    from transformers import ViTImageProcessor

    return ViTImageProcessor(size={"height": size, "width": size})


def build_classifier(model_type: str, *, seed: int = 0) -> tuple[Any, Any]:
    """(image classifier in eval mode, its processor) of the family, tiny."""
    import torch
    from transformers import AutoModelForImageClassification

    torch.manual_seed(seed)
    model = AutoModelForImageClassification.from_config(config_for(model_type)).eval()
    return model, image_processor()


def random_images(n: int, *, size: int = 32, seed: int = 0) -> list[Any]:
    """`n` RGB PIL images of random pixels."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8))
            for _ in range(n)]
