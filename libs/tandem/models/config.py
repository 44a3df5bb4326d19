"""What a Llama-family checkpoint is: sizes, rotary settings, special token ids.

Always read from the checkpoint (GGUF metadata or a Hugging Face config.json), never assumed, so
the same code serves SmolLM2, Llama 3.x and Qwen2-style models.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from tandem.errors import StartupError

# GGUF architectures whose tensors follow llama's layout (Qwen2 adds q/k/v biases and is not
# row-permuted by llama.cpp's converter; see gguf_weights.py).
GGUF_ARCHITECTURES = ("llama", "qwen2")
HF_MODEL_TYPES = ("llama", "qwen2")


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.x "llama3" frequency scaling: long wavelengths are slowed by `factor`, short ones
    kept, the band between blended. "linear" divides every frequency by `factor`."""

    rope_type: str  # "llama3" | "linear"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


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

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attention_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    @classmethod
    def from_gguf(
        cls, metadata: Mapping[str, Any], tensor_names: Collection[str], rope_freq_factors: tuple[float, ...] | None = None
    ) -> ModelConfig:
        """From GGUF key/values (`<arch>.*`, `tokenizer.ggml.*`). Tied embeddings show as a missing
        `output.weight` tensor; llama3 scaling as a `rope_freqs.weight` tensor, passed in here."""
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
            rope_scaling=_gguf_rope_scaling(metadata, arch),
            rope_freq_factors=rope_freq_factors,
            bos_token_id=_optional_int(metadata.get("tokenizer.ggml.bos_token_id")),
            eos_token_ids=() if eos is None else (int(eos),),
        )

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> ModelConfig:
        """From a Hugging Face config.json (LlamaConfig / Qwen2Config fields)."""
        model_type = config.get("model_type")
        if model_type not in HF_MODEL_TYPES:
            raise StartupError(f"config.json model_type {model_type!r} is not supported (supported: {', '.join(HF_MODEL_TYPES)})")
        hidden_size = int(config["hidden_size"])
        num_heads = int(config["num_attention_heads"])
        eos = config.get("eos_token_id")
        eos_ids = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(config.get("head_dim") or hidden_size // num_heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(config.get("rope_theta", 10000.0)),
            max_position_embeddings=int(config["max_position_embeddings"]),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", model_type == "qwen2")),
            rope_scaling=_hf_rope_scaling(config.get("rope_scaling")),
            bos_token_id=_optional_int(config.get("bos_token_id")),
            eos_token_ids=eos_ids,
        )

    def to_hf(self) -> dict[str, Any]:
        """A Hugging Face config.json for this model (what `from_hf` reads back)."""
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
            "architectures": ["Qwen2ForCausalLM" if self.attention_bias else "LlamaForCausalLM"],
            "model_type": "qwen2" if self.attention_bias else "llama",
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


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _gguf_rope_scaling(metadata: Mapping[str, Any], arch: str) -> RopeScaling | None:
    rope_type = metadata.get(f"{arch}.rope.scaling.type", "none")
    if rope_type == "none":
        return None
    if rope_type == "linear":
        return RopeScaling(rope_type="linear", factor=float(metadata[f"{arch}.rope.scaling.factor"]))
    raise StartupError(f"GGUF rope scaling {rope_type!r} is not supported (supported: none, linear, llama3 via rope_freqs)")


def _hf_rope_scaling(scaling: Mapping[str, Any] | None) -> RopeScaling | None:
    if not scaling:
        return None
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type == "default":
        return None
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
    raise StartupError(f"rope_scaling type {rope_type!r} is not supported (supported: default, linear, llama3)")
