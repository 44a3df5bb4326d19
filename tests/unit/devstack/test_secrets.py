"""Credentials: `tandem secrets DIR` writes a random set for containers readable by its owner
alone; a local work folder keeps one set, whose operator password gives each role's login."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from tandem.bus.permissions import OPERATOR, password_variable
from tandem.cli import main
from tandem.devstack.secrets import StackSecrets, load_or_create, local_service_env, login_of, redis_password_variable, with_login
from tandem.redis_acl import ROLES as REDIS_ROLES


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _env_file(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines())


def test_tandem_secrets_writes_an_env_file_and_a_file_per_secret_for_its_owner_alone(tmp_path: Path):
    assert main(["secrets", str(tmp_path / "set")]) == 0
    variables = _env_file(tmp_path / "set" / "tandem.env")
    expected = (
        {password_variable(OPERATOR)}  # no role password: services log in as their instances or with certificates
        | {
            "TANDEM_REDIS_PASSWORD",
            "TANDEM_INTERNAL_SECRET",
            "TANDEM_CASSANDRA_PASSWORD",
            "TANDEM_CASSANDRA_APP_PASSWORD",
        }
        | {redis_password_variable(role) for role in REDIS_ROLES}
    )
    assert set(variables) == expected
    assert len(set(variables.values())) == len(variables), "every secret is its own random value"
    for name, value in variables.items():
        one = tmp_path / "set" / "secrets" / name
        assert one.read_text() == value
        assert _mode(one) == 0o600
    assert _mode(tmp_path / "set" / "tandem.env") == 0o600
    assert _mode(tmp_path / "set" / "secrets") == 0o700
    assert _mode(tmp_path / "set" / "tls") == 0o700
    assert all(_mode(key) == 0o600 for key in (tmp_path / "set" / "tls").glob("*.key"))


def test_tandem_secrets_replaces_a_set_only_when_forced(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    main(["secrets", str(tmp_path)])
    before = _env_file(tmp_path / "tandem.env")
    ca_before = (tmp_path / "tls" / "ca.pem").read_bytes()
    assert main(["secrets", str(tmp_path)]) == 2
    assert "--force" in capsys.readouterr().err
    assert _env_file(tmp_path / "tandem.env") == before
    main(["secrets", str(tmp_path), "--force"])
    after = _env_file(tmp_path / "tandem.env")
    assert all(after[name] != before[name] for name in before), "a rotation changes every secret"
    assert (tmp_path / "tls" / "ca.pem").read_bytes() != ca_before, "and the CA"


def test_a_work_folder_keeps_its_set_and_the_operator_password_gives_each_role_its_own_login(tmp_path: Path):
    made = load_or_create(tmp_path)
    assert load_or_create(tmp_path) == made, "a server restarted on the folder keeps its logins"
    assert _mode(tmp_path / "secrets.env") == 0o600
    assert StackSecrets.derived_from(made.operator_password) == made
    assert len({made.operator_password, made.redis_password, made.internal_secret}) == 3
    assert load_or_create(tmp_path / "other") != made


def test_a_service_on_a_local_bus_logs_in_as_its_instance_at_the_url_without_the_operator_login(tmp_path: Path):
    made = load_or_create(tmp_path)
    url = with_login("nats://127.0.0.1:4222", "operator", made.operator_password)
    env = local_service_env("decode", "decode-7", url)
    assert env["TANDEM_NATS_URL"] == "nats://127.0.0.1:4222"
    assert (env["TANDEM_INSTANCE_ID"], env["TANDEM_NATS_USER"]) == ("decode-7", "decode-7")
    assert env["TANDEM_NATS_PASSWORD"] == made.instance_password("decode-7")
    assert env["TANDEM_INTERNAL_SECRET"] == made.internal_secret
    assert len({made.instance_password("decode-7"), made.instance_password("decode-8"), made.operator_password}) == 3
    assert local_service_env("decode", "decode-7", "nats://127.0.0.1:4222") == {
        "TANDEM_NATS_URL": "nats://127.0.0.1:4222",
        "TANDEM_INSTANCE_ID": "decode-7",
    }


@pytest.mark.parametrize("made", [StackSecrets.derived_from("operator-password"), StackSecrets.generate()])
def test_chat_and_relay_get_their_own_redis_login_and_no_other_role_gets_one(made: StackSecrets):
    logins = {role: made.service_env(role, f"{role}-0") for role in ("chat", "relay", "router", "prefill", "decode")}
    for role in ("chat", "relay"):
        assert (logins[role]["TANDEM_REDIS_USERNAME"], logins[role]["TANDEM_REDIS_PASSWORD"]) == (role, made.redis_passwords[role])
    assert len({made.redis_password, *made.redis_passwords.values()}) == 3, "no role holds the admin's password"
    for role in ("router", "prefill", "decode"):
        assert not {"TANDEM_REDIS_USERNAME", "TANDEM_REDIS_PASSWORD"} & set(logins[role]), role


def test_a_login_in_a_url_survives_characters_urls_reserve():
    url = with_login("redis://127.0.0.1:6379/0", "", "p@ss:w/rd")
    assert login_of(url) == ("redis://127.0.0.1:6379/0", "", "p@ss:w/rd")


def test_secrets_never_show_in_a_repr():
    made = StackSecrets.generate()
    assert made.redis_password not in repr(made) and made.operator_password not in repr(made)


def test_every_generated_password_starts_with_a_letter_which_nats_server_reads_as_a_string():
    """A value starting with '-' made nats-server refuse compose's config (a flaky CI failure)."""
    for _ in range(200):
        for name, value in StackSecrets.generate().variables().items():
            assert value[0].isalpha(), f"{name} starts with {value[0]!r}"
