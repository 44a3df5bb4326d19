"""The committed deploy/nats/nats.conf must be what the permission table renders now."""

from pathlib import Path

from tandem.bus.permissions import (
    OPERATOR,
    PERMISSIONS,
    SERVICE_ROLES,
    STREAM_ADMIN,
    USERS,
    literal,
    password_variable,
    render_config,
    render_container_config,
)

REPO = Path(__file__).resolve().parents[3]


def test_committed_nats_conf_is_the_rendering_of_the_permission_table():
    committed = (REPO / "deploy" / "nats" / "nats.conf").read_text()
    assert committed == render_container_config(), "regenerate deploy/nats/nats.conf from tandem.bus.permissions"


def test_container_config_takes_every_password_from_the_environment():
    rendered = render_container_config()
    for user in USERS:
        assert f"password: ${password_variable(user)}," in rendered


def test_a_literal_password_is_quoted_so_a_dollar_in_it_is_not_read_as_a_variable():
    rendered = render_config(lambda user: literal(user + "-$x"))
    assert 'password: "chat-$x",' in rendered


def test_only_workers_may_publish_tokens_and_kv_events_and_only_router_and_relay_end_a_reply():
    tokens = [u for u in USERS if "tandem.v1.tokens.>" in PERMISSIONS[u].publish]
    finals = [u for u in USERS if "tandem.v1.finals.>" in PERMISSIONS[u].publish]
    kv_events = [u for u in USERS if "tandem.v1.kv.events.>" in PERMISSIONS[u].publish]
    assert tokens == ["prefill", "decode"]
    assert finals == ["router", "relay"]
    assert kv_events == ["prefill", "decode"]


def test_each_role_publishes_only_its_own_heartbeats():
    for role in ("prefill", "decode", "router", "relay", "chat"):
        heartbeats = [s for s in PERMISSIONS[role].publish if s.startswith("tandem.v1.heartbeat.")]
        assert heartbeats == [f"tandem.v1.heartbeat.{role}.*"]


def test_no_service_role_may_create_update_or_delete_a_stream_and_the_operator_may():
    for role in SERVICE_ROLES:
        rights = PERMISSIONS[role]
        assert set(rights.publish_deny) >= set(STREAM_ADMIN), role
        assert not [s for s in rights.publish if s.startswith(("$JS.API.STREAM.CREATE", "$JS.API.STREAM.UPDATE", "$JS.API.STREAM.DELETE"))]
    assert PERMISSIONS[OPERATOR].publish == (">",)
    assert PERMISSIONS[OPERATOR].publish_deny == ()
