"""Tiny random-weight Llama models for the tests, and the naive forward every fast path is
checked against: one sequence, no KV cache, no paging, dense causal attention over the whole
sequence, recomputed from scratch for every new token.

It reuses the model's modules (norms, projections, rotary, MLP), so it checks the paged
machinery (block tables, slot mapping, chunking, the attention backend), not the weights.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from torch import nn

from tandem.kernels.metadata import AttentionFn, AttentionMetadata, KvCacheShape
from tandem.models.checkpoint_names import hf_state_dict
from tandem.models.config import ModelConfig
from tandem.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from tandem.models.quant import Int8Linear
from tandem.models.tokenizer import Tokenizer


def _dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q (T, H, D), k and v (T, KVH, D) -> (T, H, D): float32 softmax, explicit causal mask."""
    group = q.shape[1] // k.shape[1]
    keys = k.float().repeat_interleave(group, dim=1)
    values = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * scale
    length = q.shape[0]
    future = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(diagonal=1)
    scores = scores.masked_fill(future, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), values).to(q.dtype)


def _attention_block(attn: LlamaAttention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    q, k, v = attn.qkv(x, cos, sin)
    out = _dense_causal_attention(q, k, v, attn.config.attention_scale)
    return attn.o_proj(out.reshape(x.shape[0], attn.config.q_size))


@torch.inference_mode()
def reference_hidden(model: LlamaForCausalLM, token_ids: Sequence[int]) -> torch.Tensor:
    """(len, hidden_size) final-normed hidden states of the sequence, positions 0..len-1."""
    device = model.model.embed_tokens.weight.device
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=device)
    positions = torch.arange(len(token_ids), device=device)
    h = model.model.embed_tokens(ids)
    cos, sin = model.model.rotary_emb(positions)
    for layer in model.model.layers:
        assert isinstance(layer, LlamaDecoderLayer)  # a ModuleList yields plain Modules to the type checker
        h = h + _attention_block(layer.self_attn, layer.input_layernorm(h), cos, sin)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.model.norm(h)


def reference_logits(model: LlamaForCausalLM, token_ids: Sequence[int]) -> torch.Tensor:
    """(len, vocab_size) float32 logits at every position."""
    with torch.inference_mode():
        return model.compute_logits(reference_hidden(model, token_ids))


def reference_greedy(model: LlamaForCausalLM, prompt_ids: Sequence[int], max_new_tokens: int, eos_ids: Collection[int] = ()) -> list[int]:
    """Greedy continuation (new tokens only, an end token included), each step recomputing the
    whole sequence."""
    ids = list(prompt_ids)
    generated: list[int] = []
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            next_id = int(model.compute_logits(reference_hidden(model, ids)[-1:]).argmax(dim=-1).item())
            generated.append(next_id)
            ids.append(next_id)
            if next_id in eos_ids:
                break
    return generated


@torch.no_grad()
def random_model(config: ModelConfig, seed: int, attention: AttentionFn, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """A seeded random-weight model for tests. Projections are drawn with std 1/sqrt(fan_in), so
    attention scores are far from uniform (positions and cache contents change the output) and
    logits spread over several units (greedy picks are not near-ties)."""
    generator = torch.Generator().manual_seed(seed)
    model = LlamaForCausalLM(config, attention)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            values = 1.0 + 0.1 * torch.randn(param.shape, generator=generator)
        elif name.endswith("bias"):
            values = 0.1 * torch.randn(param.shape, generator=generator)
        else:
            values = torch.randn(param.shape, generator=generator) * param.shape[-1] ** -0.5
        param.copy_(values)
    return model.to(dtype)


def tiny_config(**overrides: Any) -> ModelConfig:
    """The Llama architecture at toy sizes: unit tests run in milliseconds per forward."""
    fields: dict[str, Any] = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_ids=(2,),
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def one_prefill(
    config: ModelConfig, num_tokens: int, dtype: torch.dtype = torch.float32, seed: int = 2
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(token ids, positions, a zeroed KV cache of 4 blocks of 16, its metadata) for one prompt of
    `num_tokens` (at most 32) prefilled in one step into blocks 2 and 0."""
    block_size = 16
    kv_cache = torch.zeros(KvCacheShape(4, config.num_layers, block_size, config.num_kv_heads, config.head_dim).as_tuple(), dtype=dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32),
        block_tables=torch.tensor([[2, 0]], dtype=torch.int32),
        max_query_len=num_tokens,
        max_seq_len=num_tokens,
        is_decode_only=False,
    )
    ids = torch.randint(0, config.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(seed))
    return ids, torch.arange(num_tokens), kv_cache, meta


def save_safetensors_folder(model: LlamaForCausalLM, folder: Path) -> None:
    """Writes config.json and model.safetensors under Hugging Face names."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(model.config.to_hf(), indent=2))
    save_file(hf_state_dict(model), str(folder / "model.safetensors"), metadata={"format": "pt"})


def word_tokenizer(vocab_size: int) -> Tokenizer:
    """One word per token id (`w0`, `w1`, ...), enough for an engine to detokenize whatever a
    random model writes."""
    backend = BackendTokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    return Tokenizer(backend, bos_token_id=None, eos_token_ids=(), chat_template=None)


def dequantized_copy(quantized: LlamaForCausalLM) -> LlamaForCausalLM:
    """A plain model (nn.Linear everywhere) whose projections hold int8 * scale: the reference."""
    plain = copy.deepcopy(quantized)
    with torch.no_grad():
        for module in list(plain.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, Int8Linear):
                    linear = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                    linear.weight.copy_(child.dequantized_weight())
                    if child.bias is not None:
                        linear.bias.copy_(child.bias)
                    setattr(module, name, linear.to(device=child.scale.device, dtype=child.scale.dtype))
    assert not any(isinstance(m, Int8Linear) for m in plain.modules())
    return plain


TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
# A small template of the tests' own that offers tools the Hermes way: the functions' definitions in
# a system turn, a call as a JSON object between <tool_call> tags, a tool's result a turn of its own.
TOOLS_TEMPLATE = """{% if tools %}<|im_start|>system
Call a function by answering <tool_call>{"name": ..., "arguments": {...}}</tool_call>. Functions:
{% for tool in tools %}{{ tool.function | tojson }}
{% endfor %}<|im_end|>
{% endif %}
{% for m in messages %}
{% if m.tool_calls %}<|im_start|>assistant
{% for call in m.tool_calls %}<tool_call>{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments | tojson }}}</tool_call>
{% endfor %}<|im_end|>
{% elif m.role == "tool" %}<|im_start|>tool
{{ m.tool_call_id }}: {{ m.content }}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def write_tokenizer(folder: Path) -> None:
    """A small byte-level BPE trained on the spot, saved the way transformers saves one."""
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    backend.save(str(folder / "tokenizer.json"))
    settings = {"bos_token": {"content": "<|im_start|>"}, "eos_token": "<|im_end|>", "chat_template": TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
