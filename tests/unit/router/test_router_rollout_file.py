"""The rollout file: parsed into a plan, each mistake refused with a message naming its field, and
reread only when it changes; a bad or missing file leaves the plan before it in place."""

import logging

import pytest
from prometheus_client import REGISTRY

from services.router.rollout import ModelRollout, RolloutFile, RolloutFileError, parse_rollout

GOOD = """
[models.smol]
stable = "1"
candidate = "2"
candidate_percent = 10
shadow_percent = 5

[models.big]
stable = "2026-12-01"
"""


def file_errors(reason: str) -> float:
    return REGISTRY.get_sample_value("tandem_router_rollout_file_errors_total", {"reason": reason}) or 0.0


def test_a_file_gives_each_model_its_versions_and_percents():
    plan = parse_rollout(GOOD)
    assert plan.models == {
        "smol": ModelRollout("smol", "1", "2", 10.0, 5.0),
        "big": ModelRollout("big", "2026-12-01"),
    }
    assert (plan.models["smol"].stable_id, plan.models["smol"].candidate_id) == ("smol@1", "smol@2")
    assert parse_rollout("").models == {}


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("[models.smol\nstable = '1'", "not TOML"),
        ("[other]\nx = 1", "unknown key 'other'"),
        ("[models.smol]\nstable = '1'\ncandidat = '2'", "models.smol.candidat: unknown key"),
        ("[models.smol]\ncandidate = '2'", "models.smol.stable: missing"),
        ("[models.smol]\nstable = '1'\ncandidate = '2'\ncandidate_percent = 101", "models.smol.candidate_percent: 101 is out of range"),
        ("[models.smol]\nstable = '1'\ncandidate = '2'\nshadow_percent = -1", "models.smol.shadow_percent: -1 is out of range"),
        ("[models.smol]\nstable = '1'\ncandidate = '2'\ncandidate_percent = true", "models.smol.candidate_percent: a number"),
        ("[models.smol]\nstable = '1'\ncandidate = '1'", "models.smol.candidate: '1' is the stable version too"),
        ("[models.smol]\nstable = 1", 'models.smol.stable: a version is a string (write "1")'),
        ("[models.smol]\nstable = 'a b'", "models.smol.stable: model version 'a b'"),
        ("[models.smol]\nstable = '1'\ncandidate_percent = 10", "models.smol.candidate_percent: set, but there is no candidate"),
        ('[models."smol@1"]\nstable = "1"', "models.smol@1: the model's name without a version"),
    ],
)
def test_each_mistake_is_refused_naming_its_field(text, field):
    with pytest.raises(RolloutFileError) as refused:
        parse_rollout(text)
    assert field in str(refused.value)


def test_the_file_is_reread_only_when_it_changes_and_a_bad_one_keeps_the_plan_before(tmp_path, caplog):
    path = tmp_path / "rollout.toml"
    path.write_text(GOOD)
    file = RolloutFile(path)
    assert file.reload().models["smol"].candidate_percent == 10
    assert file.reload() is None, "unchanged: nothing new"
    path.write_text(GOOD.replace("candidate_percent = 10", "candidate_percent = 50"))
    assert file.reload().models["smol"].candidate_percent == 50
    invalid_before = file_errors("invalid")
    path.write_text(GOOD.replace("candidate_percent = 10", "candidate_percent = 500"))
    with caplog.at_level(logging.ERROR, logger="services.router.rollout"):
        assert file.reload() is None
        assert file.reload() is None
    assert file_errors("invalid") == invalid_before + 1, "counted once per bad text"
    assert [r.getMessage() for r in caplog.records if "candidate_percent" in r.getMessage()] == [
        f"the rollout file {path} is not applied, the rollout before it stays: models.smol.candidate_percent: 500 is out of range (0 to 100)"
    ]
    syntax_before = file_errors("syntax")
    path.write_text("[models")
    assert file.reload() is None
    assert file_errors("syntax") == syntax_before + 1
    path.unlink()
    assert file.reload() is None, "a file removed later: the plan before stays"


def test_a_file_missing_at_start_is_no_rollout_until_it_appears(tmp_path, caplog):
    path = tmp_path / "rollout.toml"
    file = RolloutFile(path)
    with caplog.at_level(logging.WARNING, logger="services.router.rollout"):
        assert file.reload() is None
    assert f"the rollout file {path} is missing (at start: no rollout)" in caplog.text
    path.write_text(GOOD)
    assert set(file.reload().models) == {"smol", "big"}
    assert RolloutFile(None).reload() is None
