"""The Llama-family decoder over a paged KV cache, in plain torch.

Mistral, Qwen2, Qwen3, Gemma 2 and Phi-3 are this forward with the differences their ModelConfig
fields name (models/config.py): a sliding window on some layers, an RMSNorm on each head of q and k
(Qwen3), a GeGLU MLP, norms after attention and MLP too, soft-capped scores and logits and a scaled
embedding (Gemma 2). Each is applied where it acts, below, and each is off for Llama. Checkpoint
differences (Phi-3's fused tensors, Gemma's (1 + w) norms) are settled by the loader
(checkpoint_names.py). A routed MLP (mixture of experts) would be another `mlp` module of a
decoder layer, with the same forward(x) -> (T, hidden) and its own all-reduce rule.

One forward runs one engine step: the ragged batch of every sequence's new tokens (see
tandem.kernels.metadata). Attention is a pluggable function with the signature of
tandem.kernels.attention_reference.paged_attention_reference, so the torch and triton backends
share this model.

Parameter names follow Hugging Face Llama except two fusions that save matmuls on the hot path:
`self_attn.qkv_proj` holds rows [q_proj; k_proj; v_proj] and `mlp.gate_up_proj` rows
[gate_proj; up_proj]. checkpoint_names.py maps Hugging Face names onto them and back.

Within a step, a layer's parts are called by their `forward` (layers.project does the same for a
packed projection): nn.Module's `__call__` looks for hooks first, which nothing here registers,
and its cost, nine calls a layer, weighed noticeably in a batch-1 CPU decode step's Python.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels import fused_triton
from tandem.kernels.gemm_choice import bucket_of
from tandem.kernels.metadata import AttentionFn, AttentionMetadata
from tandem.models.config import ModelConfig
from tandem.models.layers import GatedMLP, RMSNorm, has_cpu_kernels, project
from tandem.models.rotary import RotaryEmbedding, apply_rotary
from tandem.models.tensor_parallel import SINGLE, TensorParallel


@contextlib.contextmanager
def _random_init_skipped() -> Iterator[None]:
    """nn.Linear's and nn.Embedding's random init made no-ops. On meta tensors it computes
    nothing anyway, but its first call imports torch's reference decompositions (seconds of a
    worker's start)."""
    names = ("kaiming_uniform_", "uniform_", "normal_")
    saved = {name: getattr(nn.init, name) for name in names}
    for name in names:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(nn.init, name, function)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, attention: AttentionFn, tp: TensorParallel = SINGLE, layer: int = 0) -> None:
        """`config`: this rank's (its heads: tensor_parallel.Shard.local_config); `layer`: its index."""
        super().__init__()
        self.config = config
        self.attention = attention
        self.tp = tp
        # nn.Module, not nn.Linear: quant.quantize_model may swap in an Int8Linear
        self.qkv_proj: nn.Module = nn.Linear(config.hidden_size, config.q_size + 2 * config.kv_size, bias=config.attention_bias)
        self.o_proj: nn.Module = nn.Linear(config.q_size, config.hidden_size, bias=False)
        # Qwen3: each head of q and of k normed before the rotation (one weight for every head)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        # Mistral's and Gemma 2's sliding layers, Gemma 2's soft-capped scores: the backend's keywords
        self.window = config.layer_window(layer)
        self.softcap = config.attn_logit_softcap or 0.0
        # An fp8 KV cache's scales for this layer (a checkpoint's k_scale, v_scale): the cache holds
        # k / k_scale and v / v_scale; 1.0 unless the checkpoint gives them.
        self.k_scale = 1.0
        self.v_scale = 1.0

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (T, num_heads, head_dim) and k, v (T, num_kv_heads, head_dim), q and k rotated."""
        c = self.config
        qkv = project(self.qkv_proj, x)
        if self.q_norm is not None and self.k_norm is not None:
            q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
            q = self.q_norm.forward(q.reshape(-1, c.head_dim)).view(-1, c.num_heads, c.head_dim)
            k = self.k_norm.forward(k.reshape(-1, c.head_dim)).view(-1, c.num_kv_heads, c.head_dim)
            return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v.reshape(-1, c.num_kv_heads, c.head_dim)
        if has_cpu_kernels(qkv):  # split and rotated in one call, the same bits
            q, k = torch.ops.tandem.rotary_qk(qkv, cos, sin, c.num_heads, c.num_kv_heads)
            return q, k, qkv[:, c.q_size + c.kv_size :].view(-1, c.num_kv_heads, c.head_dim)
        if fused_triton.serves(qkv):  # on a GPU: one launch, the same bits
            q, k = fused_triton.rotary_qk(qkv, cos, sin, c.num_heads, c.num_kv_heads)
            return q, k, qkv[:, c.q_size + c.kv_size :].view(-1, c.num_kv_heads, c.head_dim)
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = apply_rotary(q.view(-1, c.num_heads, c.head_dim), cos, sin)
        k = apply_rotary(k.view(-1, c.num_kv_heads, c.head_dim), cos, sin)
        return q, k, v.reshape(-1, c.num_kv_heads, c.head_dim)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.qkv(x, cos, sin)
        scale = self.config.attention_scale
        if self.k_scale != 1.0 or self.v_scale != 1.0:  # folded around the kernel, which applies none
            k, v, scale = k / self.k_scale, v / self.v_scale, scale * self.k_scale
        out = self.attention(q, k, v, k_cache, v_cache, meta, scale, window=self.window, softcap=self.softcap)
        if self.v_scale != 1.0:
            out = out * self.v_scale
        return self.tp.all_reduce(project(self.o_proj, out.reshape(x.shape[0], self.config.q_size)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, attention: AttentionFn, tp: TensorParallel = SINGLE, layer: int = 0) -> None:
        super().__init__()
        self.tp = tp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, attention, tp, layer)
        # Llama: the norm before the MLP. Gemma 2 (sandwich norms): the norm of the attention's
        # output, and two more around the MLP.
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        attended = self.self_attn.forward(self.input_layernorm.forward(h), cos, sin, k_cache, v_cache, meta)
        if self.sandwich:
            h = h + self.post_attention_layernorm.forward(attended)
            mlp_out = self.tp.all_reduce(self.mlp.forward(self.pre_feedforward_layernorm.forward(h)))
            return h + self.post_feedforward_layernorm.forward(mlp_out)
        h = h + attended
        return h + self.tp.all_reduce(self.mlp.forward(self.post_attention_layernorm.forward(h)))


class StepCut(Exception):
    """A forward ended between layers at its `should_cut`'s asking. The K and V it wrote are for
    positions no sequence has computed yet: the step that computes them again overwrites them
    before any attention reads them."""


AddNorm = Callable[[torch.Tensor, torch.Tensor, RMSNorm], tuple[torch.Tensor, torch.Tensor]]


def add_rms_norm_triton(residual: torch.Tensor, added: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + added, the RMSNorm of that sum) in one launch, the sum written over `residual`."""
    return residual, fused_triton.add_rms_norm(added, residual, norm.weight, norm.eps)


def add_rms_norm_cpu(residual: torch.Tensor, added: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + added, the RMSNorm of that sum) in one call of the C++ kernel, the sum a new tensor."""
    total, normed = torch.ops.tandem.add_rms_norm(residual, added, norm.weight, norm.eps)
    return total, normed


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, attention: AttentionFn, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_start, self.vocab_end = tp.shard.vocab(config)  # the token ids this rank's embedding rows are
        self.embed_tokens = nn.Embedding(tp.shard.vocab_rows(config), config.hidden_size)
        self.embedding_multiplier = config.embedding_multiplier  # Gemma's sqrt(hidden_size), else None
        self.plain_layers = config.plain_layers  # the fused GPU path serves Llama's own layers only
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, attention, tp, layer) for layer in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        # The decoder layers of a decode-only step in one call where that serves (models/packed.py
        # sets it on a CPU with every projection packed): their output before the final norm, or
        # None where it does not serve.
        self.fast_decode: (
            Callable[
                [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, Callable[[], bool] | None],
                torch.Tensor | None,
            ]
            | None
        ) = None
        # Asked between the layers of a forward (between fast_decode's calls of a few layers):
        # True ends the forward with StepCut (the engine's step is cut short for a paid request
        # that arrived during it).
        self.should_cut: Callable[[], bool] | None = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            h = self.embed_tokens(input_ids)
        else:
            # Vocab-parallel: each rank looks up the ids it holds, zero rows for the rest; the sum is exact.
            held = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
            h = self.embed_tokens((input_ids - self.vocab_start) * held)
            h = self.tp.all_reduce(h * held.unsqueeze(-1).to(h.dtype))
        if self.embedding_multiplier is not None:  # rounded to the model's dtype first, as Gemma's own code does
            h = h * torch.tensor(self.embedding_multiplier, dtype=h.dtype)
        return h

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        h = self.embed(input_ids)
        cos, sin = self.rotary_emb(positions)
        if self.fast_decode is not None and meta.is_decode_only:
            out = self.fast_decode(h, cos, sin, kv_cache, meta, self.should_cut)
            if out is not None:
                return self.norm.forward(out)
        # Each layer's K and V caches, views as kv_cache[:, index, 0] and [:, index, 1] are, in two
        # calls each instead of two indexings a layer.
        k_caches, v_caches = kv_cache.select(2, 0).unbind(1), kv_cache.select(2, 1).unbind(1)
        if self.plain_layers and fused_triton.serves(h):
            return self._forward_fused(h, cos, sin, k_caches, v_caches, meta)
        if self.plain_layers and has_cpu_kernels(h):
            return self._forward_fused(h, cos, sin, k_caches, v_caches, meta, add_norm=add_rms_norm_cpu)
        should_cut = self.should_cut
        for layer, k_cache, v_cache in zip(self.layers, k_caches, v_caches, strict=True):
            if should_cut is not None and should_cut():
                raise StepCut
            h = layer.forward(h, cos, sin, k_cache, v_cache, meta)
        return self.norm(h)

    def _forward_fused(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_caches: tuple[torch.Tensor, ...],
        v_caches: tuple[torch.Tensor, ...],
        meta: AttentionMetadata,
        add_norm: AddNorm = add_rms_norm_triton,
    ) -> torch.Tensor:
        """The layers with each residual add fused with the norm after it (one call for both): on a
        GPU fused_triton.add_rms_norm, which updates the residual stream in place, and on a CPU the
        C++ add_rms_norm (add_norm); either rounds the sum as `h + x` rounds it, so the result is
        the loop above's."""
        residual = h  # the embedding's output, this step's own tensor
        branch: torch.Tensor | None = None  # the last MLP's output, not yet added
        should_cut = self.should_cut
        for layer, k_cache, v_cache in zip(self.layers, k_caches, v_caches, strict=True):
            assert isinstance(layer, LlamaDecoderLayer)  # a ModuleList yields plain Modules to the type checker
            if should_cut is not None and should_cut():
                raise StepCut
            norm = layer.input_layernorm
            if branch is None:
                x = norm.forward(residual)
            else:
                residual, x = add_norm(residual, branch, norm)
            attended = layer.self_attn.forward(x, cos, sin, k_cache, v_cache, meta)
            residual, x = add_norm(residual, attended, layer.post_attention_layernorm)
            branch = self.tp.all_reduce(layer.mlp.forward(x))
        if branch is None:
            return self.norm.forward(residual)
        return add_norm(residual, branch, self.norm)[1]


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, attention: AttentionFn, tp: TensorParallel = SINGLE) -> None:
        """`config`: this rank's (tensor_parallel.Shard.local_config); `tp`: its rank and groups."""
        super().__init__()
        self.config = config
        self.tp = tp
        self.model = LlamaModel(config, attention, tp)
        self.logits_kernels: tuple[int, ...] = (0, 0, 0, 0)  # pack_logits'
        # Tied models have no lm_head module: a second reference to the embedding would come
        # apart under `to_empty` (each reference gets its own new tensor).
        vocab_rows = tp.shard.vocab_rows(config)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, vocab_rows, bias=False)

    @classmethod
    def empty(
        cls, config: ModelConfig, attention: AttentionFn, dtype: torch.dtype, device: torch.device | str, tp: TensorParallel = SINGLE
    ) -> LlamaForCausalLM:
        """Uninitialised parameters of `dtype` on `device`, for a loader to fill: skips the random
        init of ~all the weights it is about to overwrite."""
        with torch.device("meta"), _random_init_skipped():
            model = cls(config, attention, tp).to(dtype)
        return model.to_empty(device=device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions (T,) -> final-normed hidden states (T, hidden_size). Writes this
        step's K and V into kv_cache (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)."""
        return self.model(input_ids, positions, kv_cache, meta)

    def swap_projections(self, swap: Callable[[nn.Module], nn.Module]) -> None:
        """Every attention and MLP projection replaced by swap(projection), in place (quantizing,
        packing: the forward code stays as it is)."""
        for layer in self.model.layers:
            assert isinstance(layer, LlamaDecoderLayer)  # a ModuleList yields plain Modules to the type checker
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_proj, attn.o_proj = swap(attn.qkv_proj), swap(attn.o_proj)
            mlp.gate_up_proj, mlp.down_proj = swap(mlp.gate_up_proj), swap(mlp.down_proj)

    def logits_weight(self) -> torch.Tensor:
        """The (vocab_size, hidden_size) weight of the logits: the lm_head's, or the tied embedding's."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def pack_logits(self, weight_packed: torch.Tensor, kernels: tuple[int, ...] = (0, 0, 0, 0)) -> None:
        """Logits from now on through the CPU's packed kernel with this packing of logits_weight()
        (models/packed.py), by packed_mm's kernel per bucket of rows (kernels/gemm_choice.py; a
        negative one: torch's matmul on logits_weight())."""
        self.register_buffer("logits_packed", weight_packed, persistent=False)
        self.logits_kernels = kernels

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden_size) -> (N, vocab_size) float32; call it on the rows you sample from only
        (under tensor parallelism on every rank, with the same rows: the columns are gathered)."""
        packed = getattr(self, "logits_packed", None)
        rows = hidden.reshape(-1, hidden.shape[-1])
        kernel = self.logits_kernels[bucket_of(rows.shape[0])] if isinstance(packed, torch.Tensor) else -1
        if isinstance(packed, torch.Tensor) and hidden.dtype == packed.dtype and kernel >= 0:
            logits = torch.ops.tandem.packed_mm(rows if rows.stride(-1) == 1 else rows.contiguous(), packed, None, kernel)
            logits = logits.reshape(*hidden.shape[:-1], logits.shape[-1]).float()
        else:
            logits = F.linear(hidden, self.logits_weight()).float()
        if self.tp.size > 1:
            logits = self.tp.all_gather_columns(logits)[..., : self.config.vocab_size]
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap  # Gemma 2
