"""The triton attention kernel inside every architecture's forward (sliding windows, soft-caps,
head size 96), in triton's CPU interpreter, against transformers (triton_architectures_check.py)."""

from hf_models import ARCHITECTURES
from triton_interpreter import interpreted_results, needs_triton


@needs_triton
def test_every_architecture_with_the_triton_kernel_matches_transformers():
    results = interpreted_results("triton_architectures_check.py")
    assert {result["case"] for result in results} == set(ARCHITECTURES)
