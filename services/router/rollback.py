"""The automatic rollback's rule: over a sliding window (rollout_window_s) of the stable's and the
candidate's replies (their ReplyOutcomes, shadows left out), the candidate is rolled back once it
has at least `min_replies` there and its error rate exceeds the stable's by more than
`error_margin`, or (both having first tokens) its TTFT p95 exceeds the stable's by more than
`ttft_margin` (a fraction: 0.5 is 50 % slower)."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

ERROR_RATE = "error_rate"
TTFT = "ttft"


@dataclass(frozen=True)
class RollbackRule:
    window_s: float = 300.0
    min_replies: int = 20
    error_margin: float = 0.05
    ttft_margin: float = 0.5


@dataclass(frozen=True)
class WindowSummary:
    num_replies: int = 0
    num_errors: int = 0
    ttft_p95_s: float = 0.0  # 0: no reply with a first token

    @property
    def error_rate(self) -> float:
        return self.num_errors / self.num_replies if self.num_replies else 0.0


@dataclass(frozen=True)
class Verdict:
    reason: str  # ERROR_RATE or TTFT: the counter's label
    message: str  # for the log and RolloutStatus.rollback_reason


class VersionWindow:
    """One version's reply outcomes over the last `window_s` seconds (by the router's clock)."""

    def __init__(self, window_s: float) -> None:
        self._window_s = window_s
        self._outcomes: deque[tuple[float, float, bool]] = deque()  # (at_s, ttft_s, is_error), oldest first

    def add(self, at_s: float, ttft_s: float, is_error: bool) -> None:
        self._outcomes.append((at_s, ttft_s, is_error))

    def summary(self, now_s: float) -> WindowSummary:
        while self._outcomes and self._outcomes[0][0] < now_s - self._window_s:
            self._outcomes.popleft()
        ttfts = sorted(ttft_s for _, ttft_s, _ in self._outcomes if ttft_s > 0)
        return WindowSummary(len(self._outcomes), sum(1 for *_, is_error in self._outcomes if is_error), p95(ttfts))


def p95(sorted_values: list[float]) -> float:
    """The nearest-rank 95th percentile; 0 for none."""
    if not sorted_values:
        return 0.0
    return sorted_values[max(0, math.ceil(0.95 * len(sorted_values)) - 1)]


def verdict(stable: WindowSummary, candidate: WindowSummary, rule: RollbackRule) -> Verdict | None:
    """Why the candidate must be rolled back, or None."""
    if candidate.num_replies < rule.min_replies:
        return None
    over = f"over {rule.window_s:g} s ({candidate.num_replies} candidate and {stable.num_replies} stable replies)"
    if candidate.error_rate > stable.error_rate + rule.error_margin:
        message = f"error rate {candidate.error_rate:.2f} > stable {stable.error_rate:.2f} + {rule.error_margin:g} {over}"
        return Verdict(ERROR_RATE, message)
    if stable.ttft_p95_s > 0 and candidate.ttft_p95_s > stable.ttft_p95_s * (1 + rule.ttft_margin):
        message = f"TTFT p95 {candidate.ttft_p95_s:.3f} s > stable {stable.ttft_p95_s:.3f} s x {1 + rule.ttft_margin:g} {over}"
        return Verdict(TTFT, message)
    return None
