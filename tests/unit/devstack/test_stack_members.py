"""`tandem up --decode-workers N --prefill-workers M`: each service instance the stack plans has
its own name, instance id and ports, and settings given to `tandem up` as flags reach the
services (except those the stack sets per member)."""

from __future__ import annotations

from tandem.config import ApiKey, Tier, load_settings, settings_flags
from tandem.devstack.members import StackConfig, service_member
from tandem.devstack.stack import stack_config_from

KEYS = {"k": ApiKey(user_id="u", tier=Tier.PLUS)}


def members(config: StackConfig):
    def on_line(name: str, text: str) -> None:
        pass

    return [
        service_member(config, role, index, "nats://127.0.0.1:1", "redis://127.0.0.1:2/0", on_line)
        for role in config.roles
        for index in range(config.num_instances(role))
    ]


def test_each_worker_instance_has_its_own_name_instance_id_and_ports():
    config = StackConfig(host="127.0.0.1", chat_port=18080, api_keys=KEYS, extra_env={}, num_decode_workers=3, num_prefill_workers=2)
    planned = members(config)
    names = [m.name for m in planned]
    assert names == ["router", "relay", "prefill-0", "prefill-1", "decode-0", "decode-1", "decode-2", "chat"]
    assert len({m.instance_id for m in planned}) == len(planned)
    http_ports = [m.http_port for m in planned]
    grpc_ports = [m.grpc_port for m in planned if m.grpc_port is not None]
    assert len(grpc_ports) == 5, "every worker has a gRPC port, no other service does"
    assert len(set(http_ports + grpc_ports)) == len(http_ports) + len(grpc_ports), "no two ports clash"
    chat = planned[-1]
    assert (chat.http_port, chat.url, chat.readyz_url) == (18080, "http://127.0.0.1:18080", "http://127.0.0.1:18080/readyz")


def test_several_chat_instances_take_the_chat_port_first_then_free_ones():
    config = StackConfig(host="127.0.0.1", chat_port=18080, api_keys=KEYS, extra_env={}, num_chat_instances=2, roles=("chat",))
    first, second = members(config)
    assert (first.name, first.instance_id, first.http_port) == ("chat-0", "chat-0", 18080)
    assert second.name == "chat-1" and second.http_port not in (None, 18080)


def test_up_flags_set_the_worker_counts_and_reach_every_service_as_variables():
    args = ["--decode-workers", "2", "--prefill-workers", "0", "--stall-timeout-s", "1.5", "--instance-id", "x"]
    settings = load_settings(args, prog="tandem up")
    config = stack_config_from(settings, chat_port=None, flags={k: str(v) for k, v in settings_flags(args, "tandem up")().items()})
    assert (config.num_decode_workers, config.num_prefill_workers) == (2, 0)
    assert config.extra_env["TANDEM_STALL_TIMEOUT_S"] == "1.5"
    assert "TANDEM_DECODE_WORKERS" not in config.extra_env and "TANDEM_INSTANCE_ID" not in config.extra_env
    assert [m.name for m in members(config)] == ["router", "relay", "decode-0", "decode-1", "chat"]
