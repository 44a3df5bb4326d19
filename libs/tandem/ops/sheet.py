"""One worksheet line: a quantity, its value with units, and the formula that made it, numbers
substituted; and the sheet that records each value with its line where it is computed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Line:
    key: str  # the JSON key
    label: str
    shown: str  # the value with its unit
    formula: str  # with the numbers substituted


class Sheet:
    """Collects each value with its line as it is computed."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}
        self.lines: list[Line] = []

    def add(self, key: str, label: str, value: Any, shown: str, formula: str) -> Any:
        self.values[key] = value
        self.lines.append(Line(key, label, shown, formula))
        return value
