"""How the worksheet writes numbers: decimal units (1 GB = 1e9 B, as the GPU datasheets count),
thousands separators, and a few significant digits where more would be noise."""

from __future__ import annotations

_SI = (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3))


def _si(value: float, unit: str) -> str:
    for prefix, scale in _SI:
        if abs(value) >= scale:
            return f"{value / scale:,.4g} {prefix}{unit}"
    return f"{value:,.4g} {unit}"


def fmt_bytes(num_bytes: float) -> str:
    """Exact below a megabyte (a token's KV), three to four significant digits above."""
    return f"{num_bytes:,.0f} B" if num_bytes < 1e6 else _si(num_bytes, "B")


def fmt_flops(flops: float, per_s: bool = True) -> str:
    return _si(flops, "FLOP/s" if per_s else "FLOP")


def fmt_count(count: float) -> str:
    return f"{count:,.0f}"


def fmt_rate(rate: float) -> str:
    return f"{rate:,.0f}" if rate >= 100 else f"{rate:.1f}"


def fmt_ms(ms: float) -> str:
    if ms < 1:
        return f"{ms:.3g} ms"
    return f"{ms:,.2f} ms" if ms < 1e4 else f"{ms:,.0f} ms"


def fmt_pct(fraction: float) -> str:
    return f"{100 * fraction:g} %"


def fmt_params(num_params: int) -> str:
    return f"{num_params / 1e9:g}e9 params" if num_params >= 1e9 and num_params % 10**7 == 0 else f"{num_params:,} params"


def fmt_money(amount: float) -> str:
    return f"${amount:,.2f}" if amount >= 1 or amount == 0 else f"${amount:.3g}"
