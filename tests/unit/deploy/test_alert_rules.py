"""The alerting and recording rules (deploy/prometheus/alerts.yml, and its Kubernetes copy) pass
`promtool check rules`, and their unit tests (deploy/prometheus/alerts_test.yml) pass `promtool
test rules`: each alert fires on synthetic series that breach its SLO and stays silent on series
that do not. A rule changed so that it misses a case fails them (they can fail). Every alert is
documented in docs/operations.md.

promtool comes with Debian's prometheus package (`make promtool` installs it as root). Without it
these tests skip, or fail where TANDEM_REQUIRE_PROMTOOL=1 (CI: .ci/run)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from kustomize_lite import load_objects

ROOT = Path(__file__).resolve().parents[3]
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "alerts_test.yml"
K8S_RULES = ROOT / "deploy" / "k8s" / "overlays" / "gpu" / "alerts.yaml"
OPERATIONS = ROOT / "docs" / "operations.md"
IS_PROMTOOL_REQUIRED = os.environ.get("TANDEM_REQUIRE_PROMTOOL") == "1"
NO_PROMTOOL = "promtool is not installed: run `make promtool` (apt-get install prometheus, as root)"
SEVERITIES = {"warning", "critical"}


@pytest.fixture(scope="module")
def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        if IS_PROMTOOL_REQUIRED:
            pytest.fail(f"{NO_PROMTOOL} (TANDEM_REQUIRE_PROMTOOL=1)", pytrace=False)
        pytest.skip(NO_PROMTOOL)
    return found


def run(promtool: str, *args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool, *map(str, args)], capture_output=True, text=True, timeout=120, check=False)


def rule_groups() -> list[dict]:
    return yaml.safe_load(RULES.read_text())["groups"]


def alerts() -> list[dict]:
    return [rule for group in rule_groups() for rule in group["rules"] if "alert" in rule]


def test_the_rules_pass_promtool_check(promtool: str) -> None:
    checked = run(promtool, "check", "rules", RULES)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_kubernetes_copy_of_the_rules_passes_promtool_check(promtool: str, tmp_path: Path) -> None:
    (rule,) = load_objects(K8S_RULES)
    groups = tmp_path / "groups.yml"
    groups.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    checked = run(promtool, "check", "rules", groups)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_every_alert_fires_on_a_breach_and_stays_silent_without_one(promtool: str) -> None:
    tested = run(promtool, "test", "rules", RULE_TESTS)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_an_alert_without_its_short_window_fails_the_rule_tests(promtool: str, tmp_path: Path) -> None:
    """The fast burn alert without its 5-minute window keeps firing after the errors stopped: the
    unit tests must catch it."""
    rules = RULES.read_text()
    short_window = "\n          and tandem:chat_reply_errors:ratio_rate5m > (14.4 * 0.005)"
    assert short_window in rules
    (tmp_path / RULES.name).write_text(rules.replace(short_window, ""))
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    tested = run(promtool, "test", "rules", tmp_path / RULE_TESTS.name)
    assert tested.returncode != 0, "the rule tests passed a fast burn alert that ignores its short window"
    assert "alertname: TandemErrorBudgetBurnFast" in tested.stdout + tested.stderr


def test_every_alert_has_a_firing_and_a_silent_case() -> None:
    cases: dict[str, set[bool]] = {}
    for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for case in test.get("alert_rule_test", []):
            cases.setdefault(case["alertname"], set()).add(bool(case["exp_alerts"]))
    for alert in alerts():
        assert cases.get(alert["alert"]) == {True, False}, (
            f"{alert['alert']}: alerts_test.yml needs a case that fires and one that does not"
        )


def test_every_alert_has_a_severity_a_summary_and_a_row_in_the_operations_guide() -> None:
    guide = OPERATIONS.read_text()
    for alert in alerts():
        assert alert["labels"]["severity"] in SEVERITIES, alert["alert"]
        assert alert["annotations"]["summary"], alert["alert"]
        assert f"`{alert['alert']}`" in guide, f"{alert['alert']}: not in docs/operations.md"


def test_the_recording_rules_are_named_level_metric_operations() -> None:
    """Prometheus's naming rule for recorded series (level:metric:operations), so that they never
    collide with an exported metric."""
    records = [rule["record"] for group in rule_groups() for rule in group["rules"] if "record" in rule]
    assert records
    for record in records:
        level, metric, operations = record.split(":")
        assert level == "tandem" and metric and operations, record
