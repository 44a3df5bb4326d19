"""Kernel choice by measurement (kernels/gemm_choice.py): the policies' rules on given timings (a
fake timing source, so they hold whatever this CPU measures), the timings measured once per
machine and kept, and the AMX kernel's products: a row's bits its own at any row count, bf16
and int8 weights, close to the float64 product."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels import cpu_extension
from tandem.kernels.gemm_choice import BUCKETS, GemmChooser, GemmShape, bucket_of, choose
from tandem.models.packed import pack_weight

SHAPE = GemmShape(960, 576, torch.bfloat16, torch.bfloat16)
# seconds per call at 1, 8, 64 and 256 rows, as measured on an AMX Xeon (rounded)
AMX_HOST = {"packed": [2.0e-5, 7.0e-5, 5.2e-4, 2.0e-3], "amx": [2.2e-5, 1.6e-5, 7.0e-5, 2.6e-4], "onednn": [9.0e-5, 9.0e-5, 1.6e-4, 4.6e-4]}


def test_each_row_count_falls_in_its_bucket():
    assert [bucket_of(rows) for rows in (0, 1, 2, 8, 9, 64, 65, 5000)] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_auto_gives_one_kernel_to_every_bucket_the_best_overall_among_those_fast_at_one_row():
    assert choose(AMX_HOST, "auto") == ("amx",) * len(BUCKETS)
    # an int8 AMX tile twice as slow at one row as the dot products: batch 1 keeps the dot products
    slow_one_row = {**AMX_HOST, "amx": [4.0e-5, *AMX_HOST["amx"][1:]]}
    assert choose(slow_one_row, "auto") == ("packed",) * len(BUCKETS)
    # a host without AMX: oneDNN four times slower at one row is never auto's
    assert choose({"packed": AMX_HOST["packed"], "onednn": AMX_HOST["onednn"]}, "auto") == ("packed",) * len(BUCKETS)


def test_fastest_takes_each_bucket_s_own_and_a_forced_kernel_serves_every_bucket():
    mixed = {"packed": [1.0, 1.0, 5.0, 20.0], "onednn": [4.0, 2.0, 2.0, 4.0]}
    assert choose(mixed, "fastest") == ("packed", "packed", "onednn", "onednn")
    assert choose(mixed, "onednn") == ("onednn",) * len(BUCKETS)
    assert choose(mixed, "amx") == choose(mixed, "auto")  # not a candidate here: auto's choice
    with pytest.raises(ValueError, match="no kernel candidates"):
        choose({}, "auto")


class CountingTimer:
    """A timing source that returns given timings and counts the shapes it was asked for."""

    def __init__(self, timings: dict[str, list[float]]) -> None:
        self.timings = timings
        self.calls: list[tuple[str, tuple[str, ...]]] = []

    def __call__(self, shape: GemmShape, names):
        self.calls.append((shape.key, tuple(names)))
        return {name: self.timings[name] for name in names}


def test_a_shape_is_timed_once_and_the_next_process_reads_the_timings(tmp_path):
    path = tmp_path / "gemm.json"
    timer = CountingTimer(AMX_HOST)
    first = GemmChooser("auto", timer, path)
    assert first.kernels(SHAPE, ["packed", "amx", "onednn"]) == ("amx",) * len(BUCKETS)
    assert first.kernels(SHAPE, ["packed", "amx", "onednn"]) == ("amx",) * len(BUCKETS)
    assert len(timer.calls) == 1 and path.is_file()
    # a later worker on the machine: no timing, the same choice, and its policy applied to them
    again = CountingTimer(AMX_HOST)
    assert GemmChooser("fastest", again, path).kernels(SHAPE, ["packed", "amx", "onednn"]) == ("packed", "amx", "amx", "amx")
    assert again.calls == []
    # a kernel not timed before is timed alone
    more = CountingTimer({**AMX_HOST, "extra": [1.0] * 4})
    GemmChooser("auto", more, path).kernels(SHAPE, ["packed", "amx", "onednn", "extra"])
    assert more.calls == [(SHAPE.key, ("extra",))]


def test_auto_never_picks_a_kernel_that_changes_a_row_s_bits_with_its_batch(tmp_path):
    float_shape = GemmShape(960, 576, torch.float32, torch.float32)
    onednn_fastest = {"packed": [2.0, 2.0, 8.0, 30.0], "onednn": [1.0, 1.0, 1.0, 1.0]}
    assert GemmChooser("auto", CountingTimer(onednn_fastest), None).kernels(float_shape, ["packed", "onednn"]) == ("packed",) * len(BUCKETS)
    assert GemmChooser("fastest", CountingTimer(onednn_fastest), None).kernels(float_shape, ["packed", "onednn"]) == ("onednn",) * len(
        BUCKETS
    )
    assert GemmChooser("auto", CountingTimer(onednn_fastest), None).kernels(SHAPE, ["packed", "onednn"]) == ("onednn",) * len(BUCKETS)


def test_a_damaged_timings_file_is_measured_again_and_a_forced_or_single_kernel_times_nothing(tmp_path):
    path = tmp_path / "gemm.json"
    path.write_text('{"960x576 bfl')  # a write cut short
    timer = CountingTimer(AMX_HOST)
    assert GemmChooser("auto", timer, path).kernels(SHAPE, ["packed", "amx"]) == ("amx",) * len(BUCKETS)
    assert len(timer.calls) == 1
    untimed = CountingTimer(AMX_HOST)
    assert GemmChooser("packed", untimed, None).kernels(SHAPE, ["packed", "amx"]) == ("packed",) * len(BUCKETS)
    assert GemmChooser("auto", untimed, None).kernels(SHAPE, ["packed"]) == ("packed",) * len(BUCKETS)
    assert untimed.calls == []


def test_the_real_timer_times_every_candidate_at_every_bucket(tmp_path):
    if not cpu_extension.load():
        pytest.skip("the C++ kernels do not build here")
    dtype = torch.bfloat16 if torch.ops.tandem.packed_mm_supported(64, 64, torch.bfloat16, torch.bfloat16) else torch.float32
    if not torch.ops.tandem.packed_mm_supported(64, 64, dtype, dtype):
        pytest.skip("packed_mm serves no rows here")
    chooser = GemmChooser("auto", path=tmp_path / "gemm.json")
    shape = GemmShape(64, 64, dtype, dtype)
    timings = chooser.timings(shape, ["packed", "onednn"])
    assert set(timings) == {"packed", "onednn"}
    assert all(len(times) == len(BUCKETS) and all(0 < t < 1 for t in times) for times in timings.values())


def _amx() -> bool:
    return cpu_extension.load() and bool(torch.ops.tandem.packed_mm_amx_supported(64, torch.bfloat16))


needs_amx = pytest.mark.skipif(not _amx(), reason="the AMX kernel needs AMX-BF16 (unmeasured on this CPU)")


@needs_amx
@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("weights", ["bf16", "int8"])
def test_the_amx_kernel_gives_a_row_its_own_bits_at_any_row_count(weights, num_threads):
    """Rows alone, in twos, in calls crossing the 16-row tiles and the 256-row chunks, against
    the same rows in one call of 600 (odd counts of channel groups included: 3 x 16 channels)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        generator = torch.Generator().manual_seed(3)
        for out_features, in_features in [(48, 64), (960, 576), (576, 1536)]:
            if weights == "int8":
                weight = torch.randint(-127, 128, (out_features, in_features), generator=generator, dtype=torch.int8)
                scale = torch.rand(out_features, generator=generator).to(torch.bfloat16) / 100
            else:
                weight, scale = (torch.randn(out_features, in_features, generator=generator) / 10).to(torch.bfloat16), None
            packed = pack_weight(weight, torch.bfloat16)
            x = torch.randn(600, in_features, generator=generator).to(torch.bfloat16)
            whole = torch.ops.tandem.packed_mm(x, packed, scale, 1)
            for size in (1, 2, 15, 17, 33, 255, 257):
                parts = torch.cat([torch.ops.tandem.packed_mm(x[i : i + size], packed, scale, 1) for i in range(0, 600, size)])
                assert torch.equal(parts, whole), f"{out_features}x{in_features}, calls of {size}"
            exact = x.double() @ (weight.double() * (1 if scale is None else scale.double()[:, None])).t()
            torch.testing.assert_close(whole.double(), exact, atol=2e-2 * exact.abs().max().item(), rtol=1e-2)
    finally:
        torch.set_num_threads(previous)


@needs_amx
def test_the_amx_kernel_refuses_inputs_it_does_not_tile():
    assert not torch.ops.tandem.packed_mm_amx_supported(48, torch.bfloat16)  # not a multiple of 32
    assert not torch.ops.tandem.packed_mm_amx_supported(64, torch.float32)
    packed = pack_weight(torch.ones(16, 48, dtype=torch.bfloat16), torch.bfloat16)
    with pytest.raises(RuntimeError, match="no kernel 1"):
        torch.ops.tandem.packed_mm(torch.ones(2, 48, dtype=torch.bfloat16), packed, None, 1)


@needs_amx
@pytest.mark.parametrize("num_threads", [1, 2])
def test_the_fused_gate_up_product_gives_silu_mul_of_the_amx_product_bit_for_bit(num_threads):
    """packed_mm_silu against silu_mul of packed_mm's AMX product, for rows alone and in calls
    crossing the 16-row tiles and 256-row chunks; an int8 or odd-grouped weight is refused."""
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        generator = torch.Generator().manual_seed(4)
        for intermediate, in_features in [(1536, 576), (16, 64), (48, 96)]:
            weight = (torch.randn(2 * intermediate, in_features, generator=generator) / 10).to(torch.bfloat16)
            packed = pack_weight(weight, torch.bfloat16)
            x = torch.randn(600, in_features, generator=generator).to(torch.bfloat16)
            for size in (1, 17, 33, 257, 600):
                for i in range(0, 600, size):
                    rows = x[i : i + size]
                    expected = torch.ops.tandem.silu_mul(torch.ops.tandem.packed_mm(rows, packed, None, 1))
                    assert torch.equal(torch.ops.tandem.packed_mm_silu(rows, packed), expected), (
                        f"{intermediate}x{in_features}, rows {i}+{size}"
                    )
        int8 = pack_weight(torch.ones(32, 64, dtype=torch.int8), torch.bfloat16)
        with pytest.raises(RuntimeError, match="gate/up projection"):
            torch.ops.tandem.packed_mm_silu(torch.ones(2, 64, dtype=torch.bfloat16), int8)
        odd = pack_weight(torch.ones(48, 64, dtype=torch.bfloat16), torch.bfloat16)  # 3 groups of 16: no gate/up halves
        with pytest.raises(RuntimeError, match="gate/up projection"):
            torch.ops.tandem.packed_mm_silu(torch.ones(2, 64, dtype=torch.bfloat16), odd)
    finally:
        torch.set_num_threads(previous)


@needs_amx
def test_an_mlp_on_amx_tiles_takes_the_fused_product_with_the_unfused_bits():
    """A packed bf16 GatedMLP whose gate/up projection runs on AMX tiles calls packed_mm_silu, and
    its output is the unfused one's (gate_up, then silu_mul); on the dot-product kernel it is not
    called."""
    from tandem.models.layers import GatedMLP
    from tandem.models.packed import PackedLinear

    torch.manual_seed(5)
    mlp = GatedMLP(64, 96).to(torch.bfloat16)
    mlp.gate_up_proj, mlp.down_proj = PackedLinear.from_linear(mlp.gate_up_proj), PackedLinear.from_linear(mlp.down_proj)
    x = torch.randn(40, 64).to(torch.bfloat16)
    mlp.gate_up_proj.use_kernels(("amx",) * len(BUCKETS))
    mlp.down_proj.use_kernels(("amx",) * len(BUCKETS))
    fused = mlp.gate_up_proj.silu_mul(x)
    assert fused is not None
    assert torch.equal(mlp(x), mlp.down_proj(torch.ops.tandem.silu_mul(mlp.gate_up_proj(x))))
    mlp.gate_up_proj.use_kernels(("packed",) * len(BUCKETS))
    assert mlp.gate_up_proj.silu_mul(x) is None
    assert torch.equal(mlp(x), mlp.down_proj(torch.ops.tandem.silu_mul(mlp.gate_up_proj(x))))


@pytest.mark.parametrize("policy", ["packed", "onednn"])
def test_load_model_gives_every_packed_projection_the_policy_s_kernel(policy):
    """The embedded SmolLM2 loaded as a worker loads it (load_model's cpu_gemm, the setting's),
    then one forward: its projections and logits take the forced kernel at every row count."""
    from tandem.kernels import select_attention
    from tandem.models.loader import load_model
    from tandem.models.packed import ONEDNN, PackedLinear, kernel_codes

    if not cpu_extension.load() or not torch.ops.tandem.packed_mm_supported(576, 576, torch.bfloat16, torch.bfloat16):
        pytest.skip("bf16 rows need AVX512-BF16")
    model = load_model(None, torch.bfloat16, "cpu", select_attention("cpu"), cpu_gemm=policy).model
    projections = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert len(projections) == 4 * model.config.num_layers
    expected = kernel_codes((policy,) * len(BUCKETS))
    assert all(p.kernels == expected for p in projections) and model.logits_kernels == expected
    assert all((p.dense is not None) == (ONEDNN in expected) for p in projections)
    hidden = torch.randn(3, 576).to(torch.bfloat16)
    reference = torch.nn.functional.linear(hidden, model.logits_weight()).float()
    torch.testing.assert_close(model.compute_logits(hidden), reference, atol=5e-2, rtol=2e-2)
