"""The committed deploy/nats/nats.conf and deploy/helm/nats-values.yaml's users must be what the
permission table renders now."""

from pathlib import Path

import pytest

from tandem.bus.permissions import (
    K8S_POOL_SIZES,
    OPERATOR,
    PERMISSIONS,
    SERVICE_ROLES,
    STREAM_ADMIN,
    USERS,
    Identity,
    cert_user,
    inbox_prefix,
    literal,
    password_variable,
    render_config,
    render_container_config,
    rights_of,
    with_helm_users,
)

REPO = Path(__file__).resolve().parents[3]


def test_committed_nats_conf_is_the_rendering_of_the_permission_table():
    committed = (REPO / "deploy" / "nats" / "nats.conf").read_text()
    assert committed == render_container_config(), "regenerate deploy/nats/nats.conf from tandem.bus.permissions"


def test_committed_helm_values_hold_the_rendering_of_the_kubernetes_user_pool():
    committed = (REPO / "deploy" / "helm" / "nats-values.yaml").read_text()
    assert committed == with_helm_users(committed), "regenerate: PYTHONPATH=libs python -m tandem.bus.permissions"
    last_decode = cert_user(Identity("decode", f"decode-{K8S_POOL_SIZES['decode'] - 1}"))
    assert f'- user: "{last_decode}"' in committed


def test_container_config_maps_certificates_to_instance_users_and_holds_no_password():
    rendered = render_container_config()
    assert "verify_and_map: true" in rendered and "password" not in rendered
    for role in SERVICE_ROLES:
        assert f'{{user: "{role}-0.{role}.tandem.internal", permissions: {{' in rendered
        assert f'"tandem.v1.heartbeat.{role}.{role}-0"' in rendered
    assert '{user: "operator.tandem.internal", permissions: {' in rendered
    assert not [user for user in USERS if f'{{user: "{user}",' in rendered], "a role's user would take every instance's subjects"
    assert password_variable("decode") not in rendered


def test_a_literal_password_is_quoted_so_a_dollar_in_it_is_not_read_as_a_variable():
    rendered = render_config([("chat", PERMISSIONS["chat"], literal("chat-$x"))])
    assert 'password: "chat-$x",' in rendered


def test_only_workers_may_publish_tokens_and_kv_events_and_only_router_and_relay_end_a_reply():
    tokens = [u for u in USERS if "tandem.v1.tokens.*" in PERMISSIONS[u].publish]
    finals = [u for u in USERS if "tandem.v1.finals.>" in PERMISSIONS[u].publish]
    kv_events = [u for u in USERS if "tandem.v1.kv.events.*" in PERMISSIONS[u].publish]
    assert tokens == ["prefill", "decode"]
    assert finals == ["router", "relay"]
    assert kv_events == ["prefill", "decode"]


def test_each_role_publishes_only_its_own_heartbeats():
    for role in ("prefill", "decode", "router", "relay", "chat"):
        heartbeats = [s for s in PERMISSIONS[role].publish if s.startswith("tandem.v1.heartbeat.")]
        assert heartbeats == [f"tandem.v1.heartbeat.{role}.*"]


@pytest.mark.parametrize("role", SERVICE_ROLES)
def test_an_instances_rights_name_its_own_id_where_a_roles_name_any(role: str):
    """Its heartbeat, pings, inbox (and a worker's assignments, KV state requests, KV events and
    token batches): the subjects a role's user may use for any instance, an instance's for itself."""
    mine, roles = Identity(role, f"{role}-3").rights, PERMISSIONS[role]
    assert [s.replace(f"{role}-3", "*") for s in mine.publish] == list(roles.publish)
    assert [s.replace(f"{role}-3", "*") for s in mine.subscribe] == list(roles.subscribe)
    assert f"tandem.v1.heartbeat.{role}.{role}-3" in mine.publish and f"tandem.v1.ping.{role}-3" in mine.subscribe
    assert f"_INBOX.{role}.{role}-3.>" in mine.subscribe and inbox_prefix(role, f"{role}-3") == f"_INBOX.{role}.{role}-3"
    assert not [s for s in mine.subscribe if s.startswith("_INBOX") and s != f"_INBOX.{role}.{role}-3.>"]
    if role in ("prefill", "decode"):
        assert {f"tandem.v1.worker.{role}-3.assign", f"tandem.v1.kv.state.{role}-3"} <= set(mine.subscribe)
        assert {f"tandem.v1.tokens.batch.{role}-3", f"tandem.v1.kv.events.{role}-3"} <= set(mine.publish)


def test_an_instance_id_that_could_widen_a_subject_is_refused():
    with pytest.raises(ValueError):
        rights_of("decode", "decode.>")


def test_no_service_role_may_create_update_or_delete_a_stream_and_the_operator_may():
    for role in SERVICE_ROLES:
        rights = PERMISSIONS[role]
        assert set(rights.publish_deny) >= set(STREAM_ADMIN), role
        assert not [s for s in rights.publish if s.startswith(("$JS.API.STREAM.CREATE", "$JS.API.STREAM.UPDATE", "$JS.API.STREAM.DELETE"))]
    assert PERMISSIONS[OPERATOR].publish == (">",)
    assert PERMISSIONS[OPERATOR].publish_deny == ()
