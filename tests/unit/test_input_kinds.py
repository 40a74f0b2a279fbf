"""What a model reads, from its forward's arguments: a model that takes none of the inputs
actdb knows is refused in one sentence naming them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from actdb.errors import IngestError
from actdb.ingestion.inputs import check_inputs
from actdb.ingestion.prompts import Prompt


class _Patches(nn.Module):
    """A model that reads flattened patches (as Pix2Struct does)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4)

    def forward(self, flattened_patches: torch.Tensor) -> torch.Tensor:
        return self.norm(flattened_patches)


def test_a_model_reading_no_known_input_is_one_sentence() -> None:
    with pytest.raises(IngestError) as e:
        check_inputs([Prompt(text="hello")], _Patches(), "patches")
    msg = str(e.value)
    assert msg.startswith("model 'patches' reads no input actdb knows")
    assert "pixel_values" in msg and "input_ids" in msg and "\n" not in msg


class _Reader(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.norm(input_ids.float())


class _Generator(nn.Module):
    """A model with parts and no forward of its own (Qwen2.5-Omni's: a thinker and a talker,
    run by its generate)."""

    def __init__(self) -> None:
        super().__init__()
        self.thinker = _Reader()
        self.vocoder = nn.Linear(4, 4)
        self.talker = _Reader()


def test_a_model_without_a_forward_pass_names_its_parts_that_have_one() -> None:
    with pytest.raises(IngestError) as e:
        check_inputs([Prompt(text="hello")], _Generator(), "omni")
    msg = str(e.value)
    assert msg.startswith("model 'omni' has no forward pass for actdb to run (_Generator "
                          "defines none)")
    assert msg.endswith("('thinker', 'talker')") and "\n" not in msg
