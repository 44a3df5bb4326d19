"""The Sentinel set's configuration as written (tandem.devstack.redis_ha), before anything starts."""

from __future__ import annotations

import pytest

from tandem.devstack.certs import make_cert_set
from tandem.devstack.redis_ha import MASTER_NAME, QUORUM, RedisHA, SentinelTiming
from tandem.devstack.redis_listen import RedisTransport


def test_every_node_and_sentinel_requires_the_password_and_the_replicas_follow_the_first_primary(tmp_path):
    ha = RedisHA(tmp_path, num_replicas=2, timing=SentinelTiming(down_after_ms=1500, failover_timeout_ms=4000))
    password = ha.secrets.redis_password
    primary, *replicas = ha.nodes
    assert len(replicas) == 2 and len(ha.sentinels) == 3
    for node in ha.nodes:
        lines = (node.folder / "redis.conf").read_text().splitlines()
        assert {f"requirepass {password}", f"masterauth {password}", "appendonly yes"} <= set(lines)
        users = [line.split()[1] for line in lines if line.startswith("user ")]
        assert users == ["chat", "relay"], "every node has the roles' ACL users (ACL changes do not replicate)"
        assert (f"replicaof 127.0.0.1 {primary.port}" in lines) == (node is not primary)
    for sentinel in ha.sentinels:
        lines = (sentinel.folder / "sentinel.conf").read_text().splitlines()
        assert f"requirepass {ha.secrets.redis_sentinel_password}" in lines, "their own: the services hold it"
        assert ha.secrets.redis_sentinel_password not in (password, "")
        assert f"sentinel monitor {MASTER_NAME} 127.0.0.1 {primary.port} {QUORUM}" in lines
        assert f"sentinel auth-pass {MASTER_NAME} {password}" in lines
        assert f"sentinel down-after-milliseconds {MASTER_NAME} 1500" in lines
    assert ha.service_env()["TANDEM_REDIS_SENTINELS"] == ",".join(f"127.0.0.1:{s.port}" for s in ha.sentinels)
    assert ha.service_env()["TANDEM_REDIS_WAIT_REPLICAS"] == "1"
    assert ha.service_env()["TANDEM_REDIS_SENTINEL_PASSWORD"] == ha.secrets.redis_sentinel_password


def test_with_tls_every_node_and_sentinel_listens_on_a_tls_port_only_and_replicates_over_tls(tmp_path):
    certs = make_cert_set(tmp_path, services=("redis",))
    ha = RedisHA(tmp_path, num_replicas=2, certs=certs, transport=RedisTransport.TLS)
    tls = certs.settings("redis")
    for node, config in [(n, "redis.conf") for n in ha.nodes] + [(s, "sentinel.conf") for s in ha.sentinels]:
        lines = (node.folder / config).read_text().splitlines()
        assert "port 0" in lines and f"port {node.port}" not in lines, "no plaintext port"
        assert {f"tls-port {node.port}", "tls-replication yes", f"tls-ca-cert-file {tls.ca_file}"} <= set(lines)
        assert {f"tls-cert-file {tls.cert_file}", f"tls-key-file {tls.key_file}"} <= set(lines)
        assert node.address == f"rediss://127.0.0.1:{node.port}/0?ssl_ca_certs={tls.ca_file}"
    assert "TLS ports only" in ha.describe()


def test_without_tls_the_nodes_keep_tcp_and_say_so(tmp_path):
    ha = RedisHA(tmp_path, num_replicas=2, certs=make_cert_set(tmp_path, services=("redis",)), transport=RedisTransport.TCP)
    lines = (ha.nodes[0].folder / "redis.conf").read_text().splitlines()
    assert f"port {ha.nodes[0].port}" in lines and not any(line.startswith("tls-") for line in lines)
    assert ha.nodes[0].address.startswith("redis://") and "in clear" in ha.describe()
    with pytest.raises(ValueError, match="certificates"):
        RedisHA(tmp_path, certs=None, transport=RedisTransport.TLS)
