"""The docs' metrics table (docs/operations.md, section "## Metrics") lists every Prometheus metric Tandem defines, with
its exposed name, type and labels, and nothing that is not defined. Metrics are found in the
source (every Counter/Gauge/Histogram/Info/Summary named tandem_*), their modules imported, and
type and labels read from the registry."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

from prometheus_client import REGISTRY
from prometheus_client.metrics import MetricWrapperBase

REPO = Path(__file__).resolve().parents[2]
METRIC_CLASSES = {"Counter", "Gauge", "Histogram", "Info", "Summary", "Enum"}
ROW = re.compile(r"^\|\s*`(?P<name>tandem_\w+)`\s*\|\s*(?P<type>\w+)\s*\|(?P<labels>[^|]*)\|")


def modules_defining_metrics() -> list[str]:
    found = set()
    for root, package_root in ((REPO / "libs" / "tandem", REPO / "libs"), (REPO / "services", REPO)):
        for path in root.rglob("*.py"):
            if "v1" in path.relative_to(root).parts:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and _is_tandem_metric(node):
                    found.add(".".join(path.relative_to(package_root).with_suffix("").parts))
    return sorted(found)


def _is_tandem_metric(call: ast.Call) -> bool:
    """Counter("tandem_...", ...) and the like (collections.Counter() takes no name)."""
    name = getattr(call.func, "id", None) or getattr(call.func, "attr", None)
    first = call.args[0] if call.args else None
    return name in METRIC_CLASSES and isinstance(first, ast.Constant) and str(first.value).startswith("tandem_")


def exposed_name(metric: MetricWrapperBase) -> str:
    suffix = {"counter": "_total", "info": "_info"}.get(metric._type, "")
    return metric._name + suffix


def defined_metrics() -> dict[str, tuple[str, frozenset[str]]]:
    for module in modules_defining_metrics():
        importlib.import_module(module)
    collectors = [c for c in list(REGISTRY._collector_to_names) if isinstance(c, MetricWrapperBase)]
    return {exposed_name(c): (c._type, frozenset(c._labelnames)) for c in collectors if c._name.startswith("tandem_")}


def documented_metrics() -> dict[str, tuple[str, frozenset[str]]]:
    text = (REPO / "docs" / "operations.md").read_text()
    start = text.index("\n## Metrics\n")
    end = text.find("\n## ", start + 1)
    section = text[start : end if end > 0 else len(text)]
    rows = {}
    for line in section.splitlines():
        match = ROW.match(line)
        if match:
            labels = frozenset(re.findall(r"`(\w+)`", match["labels"]))
            rows[match["name"]] = (match["type"], labels)
    return rows


def test_the_docs_table_lists_every_metric_with_its_type_and_labels_and_nothing_else():
    defined, documented = defined_metrics(), documented_metrics()
    assert len(defined) > 40, "the metric modules were not found"
    missing = sorted(set(defined) - set(documented))
    extra = sorted(set(documented) - set(defined))
    assert not missing, f"defined but not in the metrics table of docs/operations.md: {missing}"
    assert not extra, f"in the metrics table of docs/operations.md but not defined: {extra}"
    wrong = {name: (documented[name], defined[name]) for name in defined if documented[name] != defined[name]}
    assert not wrong, f"docs/operations.md says (type, labels), the code has: {wrong}"
