"""What a Llama-family checkpoint is: sizes, rotary settings, special token ids, and what its
architecture does differently from Llama's forward.

Always read from the checkpoint (GGUF metadata or a Hugging Face config.json), never assumed, so
the same code serves SmolLM2, Llama 3.x, Qwen2/Qwen3, Mistral, Gemma 2 and Phi-3. Every difference
from Llama is one field below, off by default, read in `from_hf`'s table of architectures;
models/llama.py applies each where it acts.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from tandem.errors import StartupError

# GGUF architectures, as llama.cpp's converter writes them (Mistral's is "llama"; Qwen2 adds q/k/v
# biases; gguf_weights.py renames each one's tensors and undoes llama's Q/K row permutation).
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "phi3")
HF_MODEL_TYPES = ("llama", "qwen2", "mistral", "qwen3", "gemma2", "phi3")
ACTIVATIONS = ("silu", "gelu_tanh")  # the gated MLP's: SwiGLU | GeGLU


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.x "llama3" frequency scaling: long wavelengths are slowed by `factor`, short ones
    kept, the band between blended. "linear" divides every frequency by `factor`. "longrope"
    (Phi-3): each frequency divided by its own factor, `short_factor`'s for positions inside the
    original window and `long_factor`'s past it, cos and sin multiplied by `attention_factor`."""

    rope_type: str  # "llama3" | "linear" | "longrope"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    long_factor: tuple[float, ...] = ()
    short_factor: tuple[float, ...] = ()
    attention_factor: float | None = None  # longrope: None is sqrt(1 + ln(factor) / ln(original window))


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int  # the context window in tokens
    tie_word_embeddings: bool
    attention_bias: bool = False  # q/k/v projections carry biases (Qwen2)
    rope_scaling: RopeScaling | None = None
    # llama.cpp stores llama3 scaling as a tensor of per-frequency divisors instead of parameters
    rope_freq_factors: tuple[float, ...] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # What the architecture does differently from Llama (all off for llama):
    architecture: str = "llama"  # the Hugging Face model_type (HF_MODEL_TYPES)
    sliding_window: int | None = None  # a sliding layer's token attends to its last `sliding_window` positions only
    sliding_layers: tuple[bool, ...] | None = None  # which layers slide (Gemma 2: every other); None: all, given a window
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head of q and of k, before the rotation
    hidden_act: str = "silu"  # the gated MLP's activation (ACTIVATIONS)
    norm_weight_offset: float = 0.0  # Gemma: RMSNorm scales by (offset + weight); the loader adds it to the weights
    sandwich_norms: bool = False  # Gemma 2: attention and MLP outputs normed too, before their residual add
    embedding_multiplier: float | None = None  # Gemma: the embedding scaled by sqrt(hidden_size), in the model's dtype
    attn_logit_softcap: float | None = None  # Gemma 2: attention scores -> cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # Gemma 2: the same on the logits
    query_pre_attn_scalar: float | None = None  # Gemma 2: the attention scale is this ** -0.5, not head_dim's

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
        if self.sliding_layers is not None and len(self.sliding_layers) != self.num_layers:
            raise ValueError(f"sliding_layers names {len(self.sliding_layers)} layers, the model has {self.num_layers}")

    def layer_window(self, layer: int) -> int:
        """How many positions back layer `layer`'s tokens attend (counting their own), 0 for all."""
        if self.sliding_window is None or (self.sliding_layers is not None and not self.sliding_layers[layer]):
            return 0
        return self.sliding_window

    @property
    def plain_layers(self) -> bool:
        """Every layer is Llama's own: the fused fast paths (the CPU's decode layers in one call, the
        GPU's fused norms) serve this model. Differences from Llama go the plain forward."""
        return (
            self.sliding_window is None
            and not self.qk_norm
            and self.hidden_act == "silu"
            and not self.sandwich_norms
            and self.embedding_multiplier is None
            and self.attn_logit_softcap is None
            and self.query_pre_attn_scalar is None
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attention_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar)

    @classmethod
    def from_gguf(
        cls,
        metadata: Mapping[str, Any],
        tensor_names: Collection[str],
        rope_freq_factors: tuple[float, ...] | None = None,
        longrope_factors: tuple[tuple[float, ...], tuple[float, ...]] | None = None,
    ) -> ModelConfig:
        """From GGUF key/values (`<arch>.*`, `tokenizer.ggml.*`). Tied embeddings show as a missing
        `output.weight` tensor; llama3 scaling as a `rope_freqs.weight` tensor, passed in here;
        Phi-3's longrope as its `rope_factors_long` and `rope_factors_short` tensors, passed in as
        `longrope_factors` (long, short)."""
        arch = metadata.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise StartupError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(GGUF_ARCHITECTURES)})")

        def key(name: str, default: Any = None) -> Any:
            value = metadata.get(f"{arch}.{name}", default)
            if value is None:
                raise StartupError(f"GGUF metadata lacks {arch}.{name}")
            return value

        hidden_size = int(key("embedding_length"))
        num_heads = int(key("attention.head_count"))
        vocab_size = metadata.get(f"{arch}.vocab_size") or len(metadata.get("tokenizer.ggml.tokens", ()))
        if not vocab_size:
            raise StartupError(f"GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
        eos = metadata.get("tokenizer.ggml.eos_token_id")
        return cls(
            vocab_size=int(vocab_size),
            hidden_size=hidden_size,
            intermediate_size=int(key("feed_forward_length")),
            num_layers=int(key("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(key("attention.head_count_kv", num_heads)),
            head_dim=int(key("attention.key_length", hidden_size // num_heads)),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            max_position_embeddings=int(key("context_length")),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            rope_scaling=_gguf_rope_scaling(metadata, arch, longrope_factors),
            rope_freq_factors=rope_freq_factors,
            bos_token_id=_optional_int(metadata.get("tokenizer.ggml.bos_token_id")),
            eos_token_ids=() if eos is None else (int(eos),),
            **_gguf_differences(arch, metadata),
        )

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> ModelConfig:
        """From a Hugging Face config.json (LlamaConfig, Qwen2Config, MistralConfig, Qwen3Config,
        Gemma2Config, Phi3Config fields; rotary settings top-level or in transformers 5's
        `rope_parameters`)."""
        model_type = config.get("model_type")
        if model_type not in HF_MODEL_TYPES:
            raise StartupError(f"config.json model_type {model_type!r} is not supported (supported: {', '.join(HF_MODEL_TYPES)})")
        hidden_size = int(config["hidden_size"])
        num_heads = int(config["num_attention_heads"])
        eos = config.get("eos_token_id")
        eos_ids = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
        rope = dict(config.get("rope_parameters") or {})  # transformers 5 keeps rope_theta and the scaling here
        rope_theta = rope.pop("rope_theta", None) or config.get("rope_theta", 10000.0)
        if float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))) != 1.0:
            raise StartupError("config.json asks for a partial rotary factor; only whole-head rotation is supported")
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(config.get("head_dim") or hidden_size // num_heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(config["max_position_embeddings"]),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", model_type == "gemma2")),
            attention_bias=bool(config.get("attention_bias", model_type == "qwen2")),
            rope_scaling=_hf_rope_scaling(config.get("rope_scaling") or rope or None, config),
            bos_token_id=_optional_int(config.get("bos_token_id")),
            eos_token_ids=eos_ids,
            architecture=model_type,
            **_hf_sliding_window(model_type, config),
            **_hf_differences(model_type, config, hidden_size),
        )

    def to_hf(self) -> dict[str, Any]:
        """A Hugging Face config.json for this model (what `from_hf` reads back): Llama and Qwen2
        shapes only (the tests write the other architectures' configs with transformers itself)."""
        if not self.plain_layers or self.architecture not in ("llama", "qwen2"):
            raise ValueError(f"to_hf writes llama and qwen2 configs only, not {self.architecture}'s")
        if self.rope_freq_factors is not None:
            raise ValueError("per-frequency rope divisors (a GGUF's rope_freqs) have no config.json form")
        scaling = None
        if self.rope_scaling is not None:
            s = self.rope_scaling
            scaling = {"rope_type": s.rope_type, "factor": s.factor}
            if s.rope_type == "llama3":
                scaling |= {
                    "low_freq_factor": s.low_freq_factor,
                    "high_freq_factor": s.high_freq_factor,
                    "original_max_position_embeddings": s.original_max_position_embeddings,
                }
        return {
            "architectures": ["Qwen2ForCausalLM" if self.architecture == "qwen2" else "LlamaForCausalLM"],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids),
        }


# config.json's activation names -> ACTIVATIONS
_HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def _hf_differences(model_type: str, config: Mapping[str, Any], hidden_size: int) -> dict[str, Any]:
    """What `model_type`'s forward does unlike Llama's, as ModelConfig fields (the sliding window apart)."""
    act_name = config.get("hidden_activation") or config.get("hidden_act", "silu")
    if act_name not in _HF_ACTIVATIONS:
        raise StartupError(f"config.json activation {act_name!r} is not supported (supported: {', '.join(_HF_ACTIVATIONS)})")
    out: dict[str, Any] = {"hidden_act": _HF_ACTIVATIONS[act_name]}
    if model_type == "qwen3":
        out["qk_norm"] = True
    if model_type == "gemma2":
        softcap = config.get("attn_logit_softcapping")
        final = config.get("final_logit_softcapping")
        out |= {
            "norm_weight_offset": 1.0,
            "sandwich_norms": True,
            "embedding_multiplier": math.sqrt(hidden_size),
            "attn_logit_softcap": None if softcap is None else float(softcap),
            "final_logit_softcap": None if final is None else float(final),
            "query_pre_attn_scalar": float(config.get("query_pre_attn_scalar", 256)),
        }
    return out


def _hf_sliding_window(model_type: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """sliding_window and sliding_layers from config.json: `layer_types` where it is written
    (transformers 5), else each architecture's rule (Gemma 2: even layers slide; Qwen2/Qwen3: only
    with use_sliding_window, from layer max_window_layers on; Mistral, Phi-3: every layer)."""
    window = config.get("sliding_window")
    num_layers = int(config["num_hidden_layers"])
    if model_type in ("qwen2", "qwen3") and not config.get("use_sliding_window", False):
        window = None
    if not window or model_type == "llama":
        return {}
    layer_types = config.get("layer_types")
    if layer_types is not None:
        sliding = tuple(kind == "sliding_attention" for kind in layer_types)
    elif model_type == "gemma2":
        sliding = tuple(layer % 2 == 0 for layer in range(num_layers))
    elif model_type in ("qwen2", "qwen3"):
        first = int(config.get("max_window_layers", num_layers))
        sliding = tuple(layer >= first for layer in range(num_layers))
    else:
        sliding = (True,) * num_layers
    if not any(sliding):
        return {}
    return {"sliding_window": int(window), "sliding_layers": None if all(sliding) else sliding}


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _gguf_differences(arch: str, metadata: Mapping[str, Any]) -> dict[str, Any]:
    """What `arch`'s forward does unlike Llama's, as ModelConfig fields, from GGUF metadata and
    tensors, with llama.cpp's defaults where a key is optional."""
    out: dict[str, Any] = {"architecture": arch}
    num_layers = int(metadata[f"{arch}.block_count"])
    window = int(metadata.get(f"{arch}.attention.sliding_window") or 0)
    if arch == "qwen3":
        out["qk_norm"] = True
    elif arch == "phi3" and window:  # every layer slides; 0 is none (Phi-4)
        out["sliding_window"] = window
    elif arch == "gemma2":
        hidden_size = int(metadata[f"{arch}.embedding_length"])
        num_heads = int(metadata[f"{arch}.attention.head_count"])
        head_dim = int(metadata.get(f"{arch}.attention.key_length", hidden_size // num_heads))
        out |= {
            "hidden_act": "gelu_tanh",
            "norm_weight_offset": 0.0,  # llama.cpp's converter stores Gemma's norms as (1 + w) already
            "sandwich_norms": True,
            "embedding_multiplier": math.sqrt(hidden_size),
            "attn_logit_softcap": float(metadata.get(f"{arch}.attn_logit_softcapping", 50.0)),
            "final_logit_softcap": float(metadata.get(f"{arch}.final_logit_softcapping", 30.0)),
            # the file does not say it: llama.cpp scales by the head size, but by hidden/heads for the
            # 46-layer (27B) model, as that model's query_pre_attn_scalar is
            "query_pre_attn_scalar": float(hidden_size // num_heads if num_layers == 46 else head_dim),
            "sliding_window": window or 4096,
            "sliding_layers": tuple(layer % 2 == 0 for layer in range(num_layers)),
        }
    return out


def _gguf_rope_scaling(
    metadata: Mapping[str, Any], arch: str, longrope_factors: tuple[tuple[float, ...], tuple[float, ...]] | None = None
) -> RopeScaling | None:
    if longrope_factors is not None:  # Phi-3: the factors are tensors, the rest metadata
        original = int(metadata.get(f"{arch}.rope.scaling.original_context_length", 0))
        if not original:
            raise StartupError(f"GGUF has rope_factors_long/short but no {arch}.rope.scaling.original_context_length")
        attention_factor = metadata.get(f"{arch}.rope.scaling.attn_factor")
        long_factor, short_factor = longrope_factors
        return RopeScaling(
            rope_type="longrope",
            factor=int(metadata[f"{arch}.context_length"]) / original,
            original_max_position_embeddings=original,
            long_factor=long_factor,
            short_factor=short_factor,
            attention_factor=None if attention_factor is None else float(attention_factor),
        )
    rope_type = metadata.get(f"{arch}.rope.scaling.type", "none")
    if rope_type == "none":
        return None
    if rope_type == "linear":
        return RopeScaling(rope_type="linear", factor=float(metadata[f"{arch}.rope.scaling.factor"]))
    raise StartupError(f"GGUF rope scaling {rope_type!r} is not supported (supported: none, linear, llama3 via rope_freqs)")


def _hf_rope_scaling(scaling: Mapping[str, Any] | None, config: Mapping[str, Any]) -> RopeScaling | None:
    if not scaling:
        return None
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type == "default":
        return None
    if rope_type in ("longrope", "su"):
        original = int(scaling.get("original_max_position_embeddings") or config["original_max_position_embeddings"])
        attention_factor = scaling.get("attention_factor")
        return RopeScaling(
            rope_type="longrope",
            factor=float(scaling.get("factor") or int(config["max_position_embeddings"]) / original),
            original_max_position_embeddings=original,
            long_factor=tuple(float(f) for f in scaling["long_factor"]),
            short_factor=tuple(float(f) for f in scaling["short_factor"]),
            attention_factor=None if attention_factor is None else float(attention_factor),
        )
    if rope_type == "linear":
        return RopeScaling(rope_type="linear", factor=float(scaling["factor"]))
    if rope_type == "llama3":
        return RopeScaling(
            rope_type="llama3",
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    raise StartupError(f"rope_scaling type {rope_type!r} is not supported (supported: default, linear, llama3, longrope)")
