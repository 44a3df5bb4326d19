"""The Sentinel set's configuration as written (tandem.devstack.redis_ha), before anything starts."""

from __future__ import annotations

from tandem.devstack.redis_ha import MASTER_NAME, QUORUM, RedisHA, SentinelTiming


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
