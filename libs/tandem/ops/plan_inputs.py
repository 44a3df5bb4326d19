"""What the worksheet is asked: the deployment, the traffic at peak, and the assumptions a planner
may change (each a `tandem plan` flag; the defaults are the issue's)."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.errors import StartupError


@dataclass(frozen=True)
class Deployment:
    gpus_per_replica: int = 1  # one model copy, tensor-parallel over this many GPUs
    context_tokens: int = 2000  # every sequence is sized at this many tokens of KV
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    gpus_per_server: int = 8
    max_sequences: int | None = None  # the engine's cap on running sequences; None: as many as the KV holds


@dataclass(frozen=True)
class Traffic:
    """Peak load; both zero: size one replica only, no fleet."""

    output_tokens_per_s: float = 0.0
    prompt_tokens_per_s: float = 0.0  # uncached prompt tokens (prefix-cache hits need no prefill)

    @property
    def is_given(self) -> bool:
        return self.output_tokens_per_s > 0 or self.prompt_tokens_per_s > 0


@dataclass(frozen=True)
class Assumptions:
    runtime_reserve: float = 0.10  # of each replica's memory: CUDA context, activations, graphs
    bandwidth_efficiency: float = 0.60  # achieved / peak HBM bandwidth in a real decode step
    compute_efficiency: float = 0.50  # achieved / peak dense FLOP/s in prefill
    headroom: float = 0.20  # capacity above peak traffic
    pue: float = 1.3  # facility power / IT power
    server_power_factor: float = 1.8  # server power / its GPUs' board power (a DGX H100: 10.2 kW for 8 x 700 W)
    kw_per_server: float | None = None  # None: gpus per server x board power x server_power_factor
    gpu_hour_price: float | None = None  # None: the GPU table's indicative price
    average_busyness: float = 0.5  # average traffic / the fleet's full-use capacity

    def __post_init__(self) -> None:
        fractions = {
            "--runtime-reserve": (self.runtime_reserve, 0.0, 1.0, False),
            "--bandwidth-efficiency": (self.bandwidth_efficiency, 0.0, 1.0, True),
            "--compute-efficiency": (self.compute_efficiency, 0.0, 1.0, True),
            "--average-busyness": (self.average_busyness, 0.0, 1.0, True),
        }
        for flag, (value, low, high, is_high_allowed) in fractions.items():
            if not (low < value < high or (value == low and not is_high_allowed) or (value == high and is_high_allowed)):
                raise StartupError(f"{flag} must be a fraction in {'(0, 1]' if is_high_allowed else '[0, 1)'}, not {value}")
        check_at_least("--headroom", self.headroom, 0.0)
        check_at_least("--pue", self.pue, 1.0)
        check_at_least("--server-power-factor", self.server_power_factor, 1.0)
        if self.kw_per_server is not None and self.kw_per_server <= 0:
            raise StartupError(f"--kw-per-server must be positive, not {self.kw_per_server}")
        if self.gpu_hour_price is not None:
            check_at_least("--gpu-hour-price", self.gpu_hour_price, 0.0)


def check_at_least(flag: str, value: float, low: float) -> None:
    if not value >= low:  # also refuses NaN
        raise StartupError(f"{flag} must be at least {low:g}, not {value}")
