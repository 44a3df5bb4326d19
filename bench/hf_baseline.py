"""The baseline: Hugging Face transformers `generate` on the same GGUF, static batches, greedy.

Needs the `bench` extra (`pip install -e '.[bench]'`). The GGUF is dequantized at load into the
same dtype the engine uses, so both sides do the same dense matmuls.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.models.files import open_model


def is_hf_available() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in ("transformers", "accelerate"))


def hf_version() -> str:
    import transformers

    return transformers.__version__


def load_hf(dtype: torch.dtype) -> torch.nn.Module:
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    dtype_kwarg = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"  # renamed in 4.56
    checkpoint = open_model(None)
    chatter = io.StringIO()  # the GGUF loader's own tqdm bar, which the logging switches miss
    try:
        with contextlib.redirect_stderr(chatter):
            model = AutoModelForCausalLM.from_pretrained(
                str(checkpoint.path.parent), gguf_file=checkpoint.path.name, **{dtype_kwarg: dtype}
            ).eval()
    except Exception:
        sys.stderr.write(chatter.getvalue())
        raise
    dtypes = {p.dtype for p in model.parameters()}
    if dtypes != {dtype}:
        raise RuntimeError(f"transformers loaded the GGUF as {dtypes}, not dense {dtype}: not the same work as ours")
    # Like ignore_eos: every row runs to max_new_tokens, and EOS is an ordinary token.
    model.generation_config.eos_token_id = None
    return model


@dataclass(frozen=True)
class HfRun:
    batch_size: int
    num_requests: int
    num_output_tokens: int  # in all
    elapsed_s: float
    output_token_ids: list[list[int]]

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.elapsed_s


def hf_generate(model: torch.nn.Module, prompts: Sequence[Sequence[int]], batch_size: int, num_new_tokens: int, pad_token_id: int) -> HfRun:
    """Greedy `generate` over `prompts` in arrival order, `batch_size` at a time, left-padded."""
    outputs: list[list[int]] = []
    elapsed_s = 0.0
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        width = max(len(p) for p in batch)
        input_ids = torch.tensor([[pad_token_id] * (width - len(p)) + list(p) for p in batch])
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        start_s = time.perf_counter()
        with torch.inference_mode():
            generated = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=num_new_tokens,
                do_sample=False,
                pad_token_id=pad_token_id,
            )
        elapsed_s += time.perf_counter() - start_s
        new_ids = generated[:, width:]
        if new_ids.shape[1] != num_new_tokens:
            raise RuntimeError(f"transformers generated {new_ids.shape[1]} tokens, not {num_new_tokens}")
        outputs.extend(new_ids.tolist())
    return HfRun(batch_size, len(prompts), len(prompts) * num_new_tokens, elapsed_s, outputs)
