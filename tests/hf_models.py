"""Tiny random checkpoints of every architecture Tandem serves, written by transformers itself
(the reference implementation), and transformers' own forward and greedy generation over them.

Each architecture's config turns on what makes it differ from Llama at toy sizes: a sliding window
shorter than the test prompts (Mistral, Gemma 2's every other layer, Phi-3), Qwen3's per-head q/k
norms, Gemma 2's soft-caps and query_pre_attn_scalar, Phi-3's head size of 96 and longrope (inside its original window).
Weights are drawn with std 1/sqrt(fan_in) and norm weights away from their neutral value, so every
difference moves the logits by far more than rounding does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from reference_model import write_tokenizer

ARCHITECTURES = ("llama", "qwen2", "mistral", "qwen3", "gemma2", "phi3")
SLIDING_WINDOW = 6  # shorter than the tests' prompts, so a token's window drops its oldest positions

_COMMON: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)

_DIFFERENCES: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": {"tie_word_embeddings": True},
    "mistral": {"sliding_window": SLIDING_WINDOW},
    "qwen3": {"tie_word_embeddings": True},
    "gemma2": {
        "sliding_window": SLIDING_WINDOW,
        "query_pre_attn_scalar": 24,
        "attn_logit_softcapping": 5.0,
        "final_logit_softcapping": 3.0,
        "tie_word_embeddings": True,
    },
    # Phi-3's head size is hidden_size / heads: 96, as in Phi-3-mini
    "phi3": {
        "hidden_size": 192,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": None,
        "sliding_window": SLIDING_WINDOW,
        # longrope as Phi-3-mini-128k's config writes it; the tests' sequences stay inside the
        # original window, where transformers and Tandem both use the short factors
        "original_max_position_embeddings": 64,
        "rope_scaling": {
            "type": "longrope",
            "short_factor": [1.0 + 0.05 * i for i in range(48)],
            "long_factor": [2.0 + 0.1 * i for i in range(48)],
        },
    },
}


def hf_config(architecture: str, **overrides: Any) -> Any:
    """A transformers config of `architecture` at toy sizes."""
    import transformers

    fields = {**_COMMON, **_DIFFERENCES[architecture], **overrides}
    if fields.get("head_dim") is None:
        fields.pop("head_dim")
    return transformers.AutoConfig.for_model(architecture, **fields)


@torch.no_grad()
def hf_model(architecture: str, seed: int = 0, **overrides: Any) -> Any:
    """A seeded random transformers model of `architecture` in float32, eager attention (the
    reference: soft-capping and sliding windows as its own code writes them)."""
    import transformers

    config = hf_config(architecture, **overrides)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    neutral = 0.0 if architecture == "gemma2" else 1.0  # Gemma scales by (1 + w)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            values = neutral + 0.2 * torch.randn(param.shape, generator=generator)
        elif name.endswith("bias"):
            values = 0.1 * torch.randn(param.shape, generator=generator)
        else:
            values = torch.randn(param.shape, generator=generator) * param.shape[-1] ** -0.5
        param.copy_(values)
    return model


def write_hf_checkpoint(architecture: str, folder: Path, seed: int = 0, **overrides: Any) -> Any:
    """Writes a random `architecture` checkpoint (config.json, model.safetensors, a small BPE
    tokenizer) into `folder` with transformers' save_pretrained; returns the transformers model."""
    model = hf_model(architecture, seed, **overrides)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    write_tokenizer(folder)
    return model


@torch.no_grad()
def hf_logits(model: Any, token_ids: list[int]) -> torch.Tensor:
    """(len, vocab) float32 logits transformers computes for the whole sequence in one forward."""
    return model(torch.tensor([token_ids])).logits[0].float()


@torch.no_grad()
def hf_greedy(model: Any, token_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation (new ids only): the argmax of its forward over the whole
    sequence, token after token, no end token stopping it (generate()'s min_new_tokens would mask
    the end token's logit instead)."""
    ids = list(token_ids)
    for _ in range(max_new_tokens):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(token_ids) :]
