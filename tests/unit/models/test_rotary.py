"""The rotary table against transformers' own rotary embedding, for Phi-3's longrope scaling:
short factors inside the original window, long factors past it, cos/sin scaled by the attention
factor."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import Phi3Config
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from tandem.models.config import ModelConfig, RopeScaling
from tandem.models.rotary import RotaryEmbedding, attention_factor

ORIGINAL_WINDOW = 64
WINDOW = 256
HEAD_DIM = 16
LONG = [1.0 + 0.75 * i for i in range(HEAD_DIM // 2)]
SHORT = [1.0 + 0.05 * i for i in range(HEAD_DIM // 2)]


def phi3_config(**rope: float) -> Phi3Config:
    return Phi3Config(
        vocab_size=64,
        hidden_size=2 * HEAD_DIM,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=WINDOW,
        original_max_position_embeddings=ORIGINAL_WINDOW,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "long_factor": LONG,
            "short_factor": SHORT,
            "original_max_position_embeddings": ORIGINAL_WINDOW,
            **rope,
        },
    )


def hf_cos_sin(config: Phi3Config, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos, sin (num_positions, head_dim) for positions 0..num_positions-1: its longrope
    picks long factors for the whole sequence once the sequence runs past the original window."""
    rotary = Phi3RotaryEmbedding(config)
    positions = torch.arange(num_positions).unsqueeze(0)
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    return cos[0], sin[0]


def tandem_cos_sin(config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = RotaryEmbedding(config)(torch.arange(config.max_position_embeddings))
    # forward gives each half once (rotate_half pairs i with i + head_dim/2); transformers repeats it
    return torch.cat([cos, cos], dim=-1).squeeze(1), torch.cat([sin, sin], dim=-1).squeeze(1)


@pytest.mark.parametrize("rope", [{}, {"attention_factor": 1.25}], ids=["default-attention-factor", "given"])
def test_longrope_table_matches_transformers_inside_and_past_the_original_window(rope):
    hf_config = phi3_config(**rope)
    config = ModelConfig.from_hf(hf_config.to_dict())
    cos, sin = tandem_cos_sin(config)

    short_cos, short_sin = hf_cos_sin(hf_config, ORIGINAL_WINDOW)
    torch.testing.assert_close(cos[:ORIGINAL_WINDOW], short_cos, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin[:ORIGINAL_WINDOW], short_sin, rtol=1e-5, atol=1e-5)

    long_cos, long_sin = hf_cos_sin(hf_config, WINDOW)
    torch.testing.assert_close(cos[ORIGINAL_WINDOW:], long_cos[ORIGINAL_WINDOW:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(sin[ORIGINAL_WINDOW:], long_sin[ORIGINAL_WINDOW:], rtol=1e-4, atol=1e-4)
    # the long and short tables differ, so one table of either throughout would fail a check above
    assert not torch.allclose(long_cos[:ORIGINAL_WINDOW], short_cos, atol=1e-3)


def test_longrope_attention_factor_defaults_to_the_papers_formula():
    config = ModelConfig.from_hf(phi3_config().to_dict())
    factor = WINDOW / ORIGINAL_WINDOW
    assert attention_factor(config) == pytest.approx(math.sqrt(1 + math.log(factor) / math.log(ORIGINAL_WINDOW)))
    # position 0's cos is the attention factor itself (angle 0)
    assert RotaryEmbedding(config).cos_sin[0, 0].item() == pytest.approx(attention_factor(config), rel=1e-6)


def test_hf_config_of_phi3_longrope_from_a_transformers_written_folder(tmp_path: Path):
    phi3_config().save_pretrained(tmp_path)
    config = ModelConfig.from_hf(json.loads((tmp_path / "config.json").read_text()))
    assert config.architecture == "phi3"
    assert config.rope_scaling == RopeScaling(
        rope_type="longrope",
        factor=WINDOW / ORIGINAL_WINDOW,
        original_max_position_embeddings=ORIGINAL_WINDOW,
        long_factor=tuple(LONG),
        short_factor=tuple(SHORT),
        attention_factor=None,
    )


def test_hf_config_of_phi3_longrope_in_the_published_form():
    """Phi-3-mini-128k-instruct's config.json shape: rope_scaling with "type", the original window
    top-level, no factor."""
    published = {
        **{k: v for k, v in phi3_config().to_dict().items() if k != "rope_parameters"},
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "longrope", "long_factor": LONG, "short_factor": SHORT},
    }
    scaling = ModelConfig.from_hf(published).rope_scaling
    assert scaling is not None and scaling.rope_type == "longrope"
    assert (scaling.factor, scaling.original_max_position_embeddings) == (WINDOW / ORIGINAL_WINDOW, ORIGINAL_WINDOW)
    assert scaling.long_factor == tuple(LONG) and scaling.short_factor == tuple(SHORT)
