"""`tandem up --ha`: the token stream the stack's admin step makes, and the NATS cluster's URLs as
services and tools take them."""

from __future__ import annotations

import pytest

from tandem.bus.connection import server_urls, without_credentials
from tandem.config import ApiKey, Tier, load_settings
from tandem.devstack.members import HA_NATS_NODES, StackConfig
from tandem.devstack.secrets import login_of
from tandem.devstack.stack_settings import stack_config_from
from tandem.errors import StartupError

KEYS = {"k": ApiKey(user_id="u", tier=Tier.PLUS)}


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for name in ("TANDEM_TOKEN_STREAM_REPLICAS", "TANDEM_TOKEN_STREAM_MAX_BYTES", "TANDEM_TOKEN_STREAM_MAX_AGE_S", "TANDEM_DEVICE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TANDEM_DEVICE", "cpu")


def config_of(*args: str, is_ha: bool) -> StackConfig:
    return stack_config_from(load_settings(list(args), prog="tandem up"), chat_port=18080, is_ha=is_ha)


def test_ha_puts_the_token_stream_on_every_node_and_one_node_keeps_one_replica():
    assert config_of(is_ha=True).token_stream.num_replicas == HA_NATS_NODES == config_of(is_ha=True).num_nats_nodes
    assert config_of(is_ha=False).token_stream.num_replicas == 1 == config_of(is_ha=False).num_nats_nodes
    assert config_of("--token-stream-replicas", "2", is_ha=True).token_stream.num_replicas == 2


def test_more_replicas_than_nodes_is_refused_before_anything_starts_naming_the_setting():
    with pytest.raises(StartupError, match="TANDEM_TOKEN_STREAM_REPLICAS"):
        config_of("--token-stream-replicas", "3", is_ha=False)
    with pytest.raises(StartupError, match="TANDEM_TOKEN_STREAM_REPLICAS"):
        config_of("--token-stream-replicas", "4", is_ha=True)


def test_the_stream_limits_reach_the_admin_step_not_the_services():
    config = config_of("--token-stream-max-bytes", str(64 << 20), "--token-stream-max-age-s", "3600", is_ha=True)
    assert (config.token_stream.max_bytes, config.token_stream.max_age_s) == (64 << 20, 3600)
    assert not any(name.startswith("TANDEM_TOKEN_STREAM_") for name in config.extra_env)


def test_a_cluster_url_is_every_node_and_its_logins_are_left_out_of_what_is_logged():
    url = "nats://operator:s3cret@127.0.0.1:4222, nats://operator:s3cret@127.0.0.1:4223,nats://127.0.0.1:4224"
    assert server_urls(url) == ["nats://operator:s3cret@127.0.0.1:4222", "nats://operator:s3cret@127.0.0.1:4223", "nats://127.0.0.1:4224"]
    assert without_credentials(url) == "nats://127.0.0.1:4222,nats://127.0.0.1:4223,nats://127.0.0.1:4224"
    assert without_credentials("nats://u:p@host:4222") == "nats://host:4222"  # one URL as before
    assert login_of(url) == (without_credentials(url), "operator", "s3cret")


def test_a_unix_socket_url_keeps_its_path_without_its_login():
    """tandem up's Redis on a socket (no TCP port): its URL's login left out, still a unix:// URL."""
    url = "unix://relay:s3cret@/tmp/work/redis-socket/redis.sock?db=0"
    assert without_credentials(url) == "unix:///tmp/work/redis-socket/redis.sock?db=0"
    assert login_of(url) == ("unix:///tmp/work/redis-socket/redis.sock?db=0", "relay", "s3cret")
