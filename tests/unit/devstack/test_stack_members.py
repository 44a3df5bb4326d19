"""`tandem up --decode-workers N --prefill-workers M --chat-instances K`: each service instance the
stack plans has its own name, instance id and ports (chat instances on consecutive ports, each
checked free before anything starts), and settings given to `tandem up` as flags reach the
services (except those the stack sets per member)."""

from __future__ import annotations

import io
import os
import socket

import pytest

from tandem.config import ApiKey, Tier, load_settings, settings_flags
from tandem.devstack.certs import make_cert_set
from tandem.devstack.devices import torch_threads_per_rank
from tandem.devstack.members import Console, StackConfig, check_chat_ports_free, dev_api_keys, service_member
from tandem.devstack.proc import free_ports
from tandem.devstack.secrets import CASSANDRA_LOGIN, StackSecrets
from tandem.devstack.stack import Stack, stack_config_from
from tandem.errors import StartupError
from tandem.key_file import MIN_KEY_BYTES, num_key_bytes_of
from tandem.store.cassandra_roles import APP_ROLE

KEYS = {"k": ApiKey(user_id="u", tier=Tier.PLUS)}
SECRETS = StackSecrets.generate()


@pytest.fixture(autouse=True)
def on_the_cpu(monkeypatch):
    """The host's GPUs play no part here (test_worker_ranks.py gives the stack some)."""
    monkeypatch.setenv("TANDEM_DEVICE", "cpu")


def members(config: StackConfig):
    def on_line(name: str, text: str) -> None:
        pass

    return [
        service_member(config, role, index, "nats://127.0.0.1:1", "redis://127.0.0.1:2/0", SECRETS, on_line, pool)
        for role, index, pool in config.planned()
    ]


def test_each_worker_instance_has_its_own_name_instance_id_and_ports():
    config = StackConfig(host="127.0.0.1", chat_port=18080, api_keys=KEYS, extra_env={}, num_decode_workers=3, num_prefill_workers=2)
    planned = members(config)
    names = [m.name for m in planned]
    assert names == ["router", "relay", "prefill-0", "prefill-1", "decode-0", "decode-1", "decode-2", "chat"]
    assert len({m.instance_id for m in planned}) == len(planned)
    http_ports = [m.http_port for m in planned] + [m.ops_port for m in planned]
    grpc_ports = [m.grpc_port for m in planned if m.grpc_port is not None]
    assert len(grpc_ports) == 5, "every worker has a gRPC port, no other service does"
    assert len(set(http_ports + grpc_ports)) == len(http_ports) + len(grpc_ports), "no two ports clash"
    chat = planned[-1]
    assert (chat.http_port, chat.url) == (18080, "http://127.0.0.1:18080")
    assert chat.readyz_url == f"{chat.ops_url}/readyz" == f"http://127.0.0.1:{chat.ops_port}/readyz", "readiness on the ops port"
    assert all(m.env["TANDEM_OPS_PORT"] == str(m.ops_port) for m in planned)


def test_only_the_chat_is_handed_the_api_keys(monkeypatch):
    monkeypatch.setenv("TANDEM_API_KEYS", "from-the-shell=u:plus")  # the caller's environment reaches no other role
    monkeypatch.setenv("TANDEM_API_KEYS_FILE", "/keys")
    config = StackConfig(host="127.0.0.1", chat_port=18080, api_keys=KEYS, extra_env={}, num_decode_workers=1, num_prefill_workers=1)
    given = {m.role: {name for name in m.env if name.startswith("TANDEM_API_KEYS")} for m in members(config)}
    assert given == {
        "router": set(),
        "relay": set(),
        "prefill": set(),
        "decode": set(),
        "chat": {"TANDEM_API_KEYS", "TANDEM_API_KEYS_FILE"},
    }
    assert next(m for m in members(config) if m.role == "chat").env["TANDEM_API_KEYS"] == "k=u:plus"


def test_dev_keys_carry_the_minimum_random_bytes():
    key = next(iter(dev_api_keys()))
    assert key.startswith("tdm-dev-")  # as the docs show it
    assert num_key_bytes_of(key) >= MIN_KEY_BYTES
    assert key != next(iter(dev_api_keys()))


def test_chat_instances_take_consecutive_ports_from_the_chat_port():
    config = StackConfig(host="127.0.0.1", chat_port=18080, api_keys=KEYS, extra_env={}, num_chat_instances=3, roles=("chat",))
    planned = members(config)
    assert [(m.name, m.instance_id, m.http_port) for m in planned] == [
        ("chat-0", "chat-0", 18080),
        ("chat-1", "chat-1", 18081),
        ("chat-2", "chat-2", 18082),
    ]
    assert [m.url for m in planned] == [f"http://127.0.0.1:{port}" for port in config.chat_ports]


def test_up_flags_set_the_worker_counts_and_reach_every_service_as_variables():
    args = ["--decode-workers", "2", "--prefill-workers", "0", "--stall-timeout-s", "1.5", "--instance-id", "x"]
    settings = load_settings(args, prog="tandem up")
    config = stack_config_from(settings, chat_port=None, flags={k: str(v) for k, v in settings_flags(args, "tandem up")().items()})
    assert (config.num_decode_workers, config.num_prefill_workers) == (2, 0)
    assert config.extra_env["TANDEM_STALL_TIMEOUT_S"] == "1.5"
    assert "TANDEM_DECODE_WORKERS" not in config.extra_env and "TANDEM_INSTANCE_ID" not in config.extra_env
    assert [m.name for m in members(config)] == ["router", "relay", "decode-0", "decode-1", "small-decode-0", "chat"]


def test_workers_split_the_cores_unless_torch_threads_is_set(monkeypatch):
    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("TANDEM_TORCH_THREADS", raising=False)
    config = StackConfig(host="127.0.0.1", chat_port=18080, api_keys=KEYS, extra_env={}, num_decode_workers=2, num_prefill_workers=1)
    planned = {m.name: m.env for m in members(config)}
    assert {name: env.get("TANDEM_TORCH_THREADS") for name, env in planned.items()} == {
        "router": None,
        "relay": None,
        "prefill": str(max(1, (cores - 1) // 3)),
        "decode-0": str(max(1, (cores - 1) // 3)),
        "decode-1": str(max(1, (cores - 1) // 3)),
        "chat": None,
    }
    flagged = StackConfig(host="127.0.0.1", chat_port=18080, api_keys=KEYS, extra_env={"TANDEM_TORCH_THREADS": "0"})
    assert {m.env.get("TANDEM_TORCH_THREADS") for m in members(flagged) if m.role in ("decode", "prefill")} == {"0"}
    monkeypatch.setenv("TANDEM_TORCH_THREADS", "3")
    assert {m.env.get("TANDEM_TORCH_THREADS") for m in members(config) if m.role in ("decode", "prefill")} == {"3"}


def test_workers_share_all_cores_but_one_which_the_services_keep_and_get_at_least_one_thread():
    assert [torch_threads_per_rank(n, num_cores=16) for n in (0, 1, 3, 4, 15, 40)] == [15, 15, 5, 3, 1, 1]
    assert torch_threads_per_rank(1, num_cores=2) == 1
    assert torch_threads_per_rank(3, num_cores=2) == 1
    assert torch_threads_per_rank(1, num_cores=1) == 1


def config_of(*args: str):
    settings = load_settings(list(args), prog="tandem up")
    return stack_config_from(settings, chat_port=18080, flags={k: str(v) for k, v in settings_flags(list(args), "tandem up")().items()})


def test_up_serves_the_embedded_model_large_and_as_int8_small_on_its_own_decode_workers():
    config = config_of("--small-decode-workers", "2", "--prefill-workers", "1")
    planned = members(config)
    assert [m.name for m in planned] == ["router", "relay", "prefill", "decode", "small-decode-0", "small-decode-1", "chat"]
    small = [m for m in planned if m.name.startswith("small-")]
    assert [(m.role, m.instance_id) for m in small] == [("decode", "small-decode-0"), ("decode", "small-decode-1")]
    assert all(m.grpc_port is not None for m in small), "each has its control server"
    assert (config.extra_env["TANDEM_LARGE_MODEL"], config.extra_env["TANDEM_SMALL_MODEL"]) == (
        "SmolLM2-135M-Instruct",
        "SmolLM2-135M-Instruct-int8",
    )
    assert config.small_worker_env == {"TANDEM_QUANTIZATION": "int8", "TANDEM_SERVED_MODEL_NAME": "SmolLM2-135M-Instruct-int8"}
    assert "TANDEM_QUANTIZATION" not in config.extra_env, "the large model's workers keep the dtype"
    assert "TANDEM_SMALL_DECODE_WORKERS" not in config.extra_env


def test_a_small_model_file_names_the_small_model_and_its_workers_load_it(tmp_path):
    small_file = tmp_path / "Tiny-Llama.gguf"
    small_file.write_bytes(b"GGUF" + bytes(12))
    config = config_of("--small-model-path", str(small_file), "--small-model-quantization", "none", "--served-model-name", "big")
    assert (config.extra_env["TANDEM_LARGE_MODEL"], config.extra_env["TANDEM_SMALL_MODEL"]) == ("big", "Tiny-Llama")
    assert config.small_worker_env["TANDEM_MODEL_PATH"] == str(small_file)
    assert config.small_worker_env["TANDEM_SERVED_MODEL_NAME"] == "Tiny-Llama"
    assert config.extra_env["TANDEM_SERVED_MODEL_NAME"] == "big", "the large model's workers keep the name given"


def test_no_small_decode_workers_serves_one_model_as_before():
    config = config_of("--small-decode-workers", "0")
    assert "TANDEM_SMALL_MODEL" not in config.extra_env and "TANDEM_LARGE_MODEL" not in config.extra_env
    assert not any(m.name.startswith("small-") for m in members(config))


def test_a_small_model_that_would_be_the_large_one_again_is_refused_in_one_line():
    with pytest.raises(StartupError, match="the small model would be SmolLM2-135M-Instruct again"):
        config_of("--small-model-quantization", "none")


def test_up_flag_and_variable_set_the_number_of_chat_instances(monkeypatch):
    args = ["--chat-instances", "3"]
    settings = load_settings(args, prog="tandem up")
    config = stack_config_from(settings, chat_port=18080, flags={k: str(v) for k, v in settings_flags(args, "tandem up")().items()})
    assert config.num_chat_instances == 3 and config.chat_ports == [18080, 18081, 18082]
    assert "TANDEM_CHAT_INSTANCES" not in config.extra_env, "the stack sets it, services do not read it"
    monkeypatch.setenv("TANDEM_CHAT_INSTANCES", "2")
    assert stack_config_from(load_settings([], prog="tandem up"), chat_port=18080).chat_ports == [18080, 18081]


def listening(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


def test_a_taken_chat_port_is_named_with_its_instance():
    first = free_ports(3)
    config = StackConfig(host="127.0.0.1", chat_port=first, api_keys=KEYS, extra_env={}, num_chat_instances=3)
    check_chat_ports_free(config)
    with listening(first + 2), pytest.raises(StartupError) as caught:
        check_chat_ports_free(config)
    assert str(caught.value).startswith(f"chat-2: port {first + 2} on 127.0.0.1 is in use")
    assert "chat-2 takes that port + 2" in str(caught.value)


def test_chat_ports_past_65535_are_refused_before_binding():
    config = StackConfig(host="127.0.0.1", chat_port=65535, api_keys=KEYS, extra_env={}, num_chat_instances=2)
    with pytest.raises(StartupError, match="chat-1 would take port 65536, past 65535"):
        check_chat_ports_free(config)


def test_free_ports_are_consecutive_and_bindable():
    first = free_ports(4)
    sockets = [listening(port) for port in range(first, first + 4)]
    for sock in sockets:
        sock.close()


async def test_a_stack_whose_chat_port_is_taken_starts_nothing():
    first = free_ports(2)
    config = StackConfig(host="127.0.0.1", chat_port=first, api_keys=KEYS, extra_env={}, num_chat_instances=2)
    out = io.StringIO()
    with listening(first + 1), pytest.raises(StartupError, match=f"chat-1: port {first + 1} "):
        await Stack(config, Console(out)).start()
    assert "started" not in out.getvalue(), out.getvalue()


def test_with_a_cassandra_store_the_callers_cassandra_ca_reaches_the_migrate_step_chat_and_relay(monkeypatch, tmp_path):
    """`tandem cassandra up`'s node has a CA of its own, not the stack's: the caller names it."""
    node_ca = str(make_cert_set(tmp_path, services=("cassandra",)).ca_file)
    monkeypatch.setenv("TANDEM_CASSANDRA_CA_FILE", node_ca)
    config = config_of("--store", "cassandra", "--decode-workers", "1", "--prefill-workers", "1")
    assert config.store_admin is not None and config.store_admin.ca_file == node_ca
    given = {m.role: m.env.get("TANDEM_CASSANDRA_CA_FILE") for m in members(config)}
    assert (given["chat"], given["relay"]) == (node_ca, node_ca)


def test_with_a_cassandra_store_chat_and_relay_get_the_app_role_and_no_service_the_callers_login(monkeypatch):
    monkeypatch.setenv("TANDEM_CASSANDRA_USERNAME", "cassandra")  # the admin's, as given to `tandem up`
    monkeypatch.setenv("TANDEM_CASSANDRA_PASSWORD", "the-admins")
    flags = ("--store", "cassandra", "--decode-workers", "1", "--prefill-workers", "1")
    config = config_of(*flags)
    assert config.store_admin is not None and (config.store_admin.username, config.store_admin.password) == ("cassandra", "the-admins")
    app_login = {"TANDEM_CASSANDRA_USERNAME": APP_ROLE, "TANDEM_CASSANDRA_PASSWORD": SECRETS.cassandra_app_password}
    for stack_config, store_login in ((config, app_login), (config_of("--decode-workers", "1", "--prefill-workers", "1"), {})):
        given = {m.role: {name: value for name, value in m.env.items() if name in CASSANDRA_LOGIN} for m in members(stack_config)}
        assert given == {
            role: store_login if role in ("chat", "relay") else {} for role in ("router", "relay", "prefill", "decode", "chat")
        }
