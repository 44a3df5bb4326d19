"""Hugging Face tensor names <-> the model's parameters (which fuse q/k/v and gate/up).

Every format's reader yields (Hugging Face name, tensor) pairs; `load_hf_weights` copies them in
and refuses a checkpoint that leaves a parameter unset or holds a tensor the model has no place
for, so a wrong checkpoint fails at load, not as garbage text.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from tandem.errors import StartupError
from tandem.models.llama import LlamaForCausalLM

# Tensors some checkpoints carry that the model derives instead.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _shards(model: LlamaForCausalLM) -> dict[str, tuple[str, int, int]]:
    """Hugging Face name -> (parameter name, first row, end row) for every loadable tensor."""
    c = model.config
    shards: dict[str, tuple[str, int, int]] = {}
    for name, param in model.named_parameters():
        shards[name] = (name, 0, param.shape[0])
    for layer in range(c.num_layers):
        attn = f"model.layers.{layer}.self_attn"
        suffixes = ("weight", "bias") if c.attention_bias else ("weight",)
        for suffix in suffixes:
            fused = f"{attn}.qkv_proj.{suffix}"
            del shards[fused]
            shards[f"{attn}.q_proj.{suffix}"] = (fused, 0, c.q_size)
            shards[f"{attn}.k_proj.{suffix}"] = (fused, c.q_size, c.q_size + c.kv_size)
            shards[f"{attn}.v_proj.{suffix}"] = (fused, c.q_size + c.kv_size, c.q_size + 2 * c.kv_size)
        mlp = f"model.layers.{layer}.mlp"
        del shards[f"{mlp}.gate_up_proj.weight"]
        shards[f"{mlp}.gate_proj.weight"] = (f"{mlp}.gate_up_proj.weight", 0, c.intermediate_size)
        shards[f"{mlp}.up_proj.weight"] = (f"{mlp}.gate_up_proj.weight", c.intermediate_size, 2 * c.intermediate_size)
    return shards


@torch.no_grad()
def load_hf_weights(model: LlamaForCausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copies Hugging Face-named tensors into the model, converting to its dtype and device."""
    shards = _shards(model)
    params = dict(model.named_parameters())
    missing = set(shards)
    unexpected: list[str] = []
    for name, tensor in weights:
        if name.endswith(IGNORED_SUFFIXES) or (name == "lm_head.weight" and model.lm_head is None):
            continue  # a tied checkpoint may still store its (identical) output matrix
        if name not in shards:
            unexpected.append(name)
            continue
        param_name, start, end = shards[name]
        target = params[param_name][start:end]
        if tuple(tensor.shape) != tuple(target.shape):
            raise StartupError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, the model expects {tuple(target.shape)}")
        target.copy_(tensor)
        missing.discard(name)
    if unexpected or missing:
        raise StartupError(
            f"checkpoint does not fit the model config: unexpected tensors {sorted(unexpected)[:5]}, missing tensors {sorted(missing)[:5]}"
        )


def hf_state_dict(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging Face names, fused parameters split (contiguous copies)."""
    params = dict(model.named_parameters())
    return {name: params[param][start:end].detach().contiguous() for name, (param, start, end) in _shards(model).items()}
