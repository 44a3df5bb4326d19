"""The data stores' and monitoring's chart values in deploy/helm (and k8ssandra's cluster) agree
with the rest: NATS has exactly tandem.bus.permissions' users (the operator and a pool per role,
each mapped from its certificate, no password), Redis and Cassandra have authentication on from their Secrets, the settings name their
services, and every metric the autoscalers and alerts use is one the services export."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from kustomize_lite import Object, load_objects, render

from tandem.bus.permissions import K8S_POOL_SIZES, OPERATOR, OPERATOR_CERT_USER, PERMISSIONS, cert_user, pool
from tandem.devstack.secrets import redis_password_variable
from tandem.redis_acl import ROLES as REDIS_ROLES

ROOT = Path(__file__).resolve().parents[3]
HELM = ROOT / "deploy" / "helm"
K8S = ROOT / "deploy" / "k8s"
SERVICE_CODE = [*(ROOT / "libs" / "tandem").rglob("*.py"), *(ROOT / "services").rglob("*.py")]
_HISTOGRAM_SERIES = re.compile(r"_(bucket|sum|count)$")


def values(name: str) -> dict:
    return yaml.safe_load((HELM / name).read_text())


def secret_generator(name: str) -> dict:
    """deploy/k8s/secrets' generator of Secret `name`: its namespace and key -> source file."""
    spec = yaml.safe_load((K8S / "secrets" / "kustomization.yaml").read_text())
    (generator,) = [g for g in spec["secretGenerator"] if g["name"] == name]
    keys = dict(source.split("=", 1) for source in generator.get("files", []))
    keys |= dict(literal.split("=", 1) for literal in generator.get("literals", []))
    return {"namespace": generator["namespace"], "keys": keys}


@pytest.fixture(scope="module")
def settings() -> dict[str, str]:
    (config_map,) = [item for item in render(K8S / "base") if item["kind"] == "ConfigMap" and item["metadata"]["name"] == "tandem-settings"]
    return config_map["data"]


def is_exported(metric: str) -> bool:
    """Whether a service defines `metric` (a histogram's _bucket/_sum/_count series by its name)."""
    name = _HISTOGRAM_SERIES.sub("", metric)
    return any(f'"{name}"' in path.read_text() for path in SERVICE_CODE)


def test_nats_users_are_the_operator_and_the_instance_pool_each_mapped_from_its_certificate() -> None:
    nats = values("nats-values.yaml")
    users = nats["config"]["merge"]["authorization"]["users"]
    expected = {OPERATOR_CERT_USER: PERMISSIONS[OPERATOR]} | {cert_user(i): i.rights for i in pool(K8S_POOL_SIZES)}
    assert [user["user"] for user in users] == list(expected)
    for user in users:
        rights = expected[user["user"]]
        assert "password" not in user, user["user"]
        assert user["permissions"]["publish"]["allow"] == list(rights.publish), user["user"]
        assert user["permissions"]["publish"].get("deny", []) == list(rights.publish_deny), user["user"]
        assert user["permissions"]["subscribe"]["allow"] == list(rights.subscribe), user["user"]
        assert user["permissions"]["allow_responses"] == rights.allow_responses, user["user"]
    assert nats["config"]["nats"]["tls"]["merge"]["verify_and_map"] is True
    assert "env" not in nats.get("container", {}), "no bus password for the server to read"
    assert nats["config"]["jetstream"]["enabled"] is True
    assert nats["natsBox"]["enabled"] is False


def test_redis_acl_users_are_the_ones_tandem_redis_acl_makes_with_passwords_from_their_secret() -> None:
    acl = values("redis-values.yaml")["auth"]["acl"]
    assert acl["enabled"] is True
    expected = [
        {
            "username": role.name,
            "enabled": "on",
            "keys": " ".join(role.key_rules(can_read_only=True)),  # the chart's images are Redis 7 or later
            "channels": "resetchannels",
            "commands": " ".join(role.command_rules(can_read_only=True)),
        }
        for role in REDIS_ROLES.values()
    ]
    assert acl["users"] == expected
    secret = secret_generator(acl["userSecret"])
    assert secret["namespace"] == secret_generator("tandem-redis")["namespace"]
    assert secret["keys"] == {role: f"generated/secrets/{redis_password_variable(role)}" for role in REDIS_ROLES}
    for role in REDIS_ROLES:  # the service logs in with the same password
        assert secret_generator(f"tandem-{role}")["keys"]["TANDEM_REDIS_PASSWORD"] == secret["keys"][role]


def test_redis_has_a_password_from_its_secret(settings: dict[str, str]) -> None:
    redis = values("redis-values.yaml")
    assert redis["auth"]["enabled"] is True
    assert redis["auth"]["existingSecret"] == "tandem-redis"
    secret = secret_generator("tandem-redis")
    assert secret["keys"][redis["auth"]["existingSecretPasswordKey"]] == "generated/secrets/TANDEM_REDIS_PASSWORD"
    assert "password" not in redis["auth"]
    # With sentinel on, the Bitnami chart's Service <release> (deploy/README.md installs release
    # redis) serves the sentinels on 26379; they name the primary, and ask for the same password.
    assert redis["sentinel"]["enabled"] is True and redis["auth"]["sentinel"] is True
    assert settings["TANDEM_REDIS_SENTINELS"] == f"redis.{secret['namespace']}.svc:26379"
    assert settings["TANDEM_REDIS_SENTINEL_MASTER"] == redis["sentinel"]["masterSet"]
    assert settings["TANDEM_REDIS_URL"].startswith(f"rediss://redis.{secret['namespace']}.svc:")
    assert redis["sentinel"]["quorum"] == 2 and redis["replica"]["replicaCount"] == 3
    assert int(settings["TANDEM_REDIS_WAIT_REPLICAS"]) >= 1, "an acknowledged event is on a replica"
    for role in ("chat", "relay"):
        keys = secret_generator(f"tandem-{role}")["keys"]
        # The chart's sentinels take the admin's password, having none of their own (docs/security.md).
        assert keys["TANDEM_REDIS_SENTINEL_PASSWORD"] == "generated/secrets/TANDEM_REDIS_PASSWORD"
        assert keys["TANDEM_REDIS_PASSWORD"] == f"generated/secrets/{redis_password_variable(role)}"


def test_cassandra_has_authentication_on_with_the_superuser_from_its_secret(settings: dict[str, str]) -> None:
    (cluster,) = load_objects(K8S / "data" / "cassandra.yaml")
    assert cluster["kind"] == "K8ssandraCluster"
    assert cluster["spec"]["auth"] is True
    secret = secret_generator(cluster["spec"]["cassandra"]["superuserSecretRef"]["name"])
    assert secret["namespace"] == cluster["metadata"]["namespace"]
    assert secret["keys"]["password"] == "generated/secrets/TANDEM_CASSANDRA_PASSWORD"
    assert set(secret["keys"]) == {"username", "password"}
    (datacenter,) = cluster["spec"]["cassandra"]["datacenters"]
    service = f"{cluster['metadata']['name']}-{datacenter['metadata']['name']}-service"  # k8ssandra's CQL Service
    assert settings["TANDEM_CASSANDRA_HOSTS"] == f"{service}.{secret['namespace']}.svc:9042"
    assert f"'{datacenter['metadata']['name']}': " in settings["TANDEM_CASSANDRA_REPLICATION"]
    assert settings["TANDEM_NATS_URL"].startswith(f"nats://nats.{secret['namespace']}.svc:")


def _hpas() -> list[Object]:
    return [item for item in render(K8S / "overlays" / "gpu") if item["kind"] == "HorizontalPodAutoscaler"]


def test_autoscalers_target_the_worker_statefulsets_on_their_load_never_request_count() -> None:
    rendered = render(K8S / "overlays" / "gpu")
    deployments = {item["metadata"]["name"] for item in rendered if item["kind"] == "StatefulSet"}
    hpas = {hpa["metadata"]["name"]: hpa for hpa in _hpas()}
    assert set(hpas) == {"prefill", "decode"}
    for name, hpa in hpas.items():
        target = hpa["spec"]["scaleTargetRef"]
        assert target["kind"] == "StatefulSet" and target["name"] == name and name in deployments
        assert all(metric["type"] == "Pods" for metric in hpa["spec"]["metrics"]), "CPU or request rate is not a worker's load"
        assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 300, "a removed worker drains first"
    decode = {metric["pods"]["metric"]["name"] for metric in hpas["decode"]["spec"]["metrics"]}
    assert decode == {"tandem_worker_kv_cache_usage_ratio", "tandem_worker_queue_wait_seconds_mean"}
    prefill = {metric["pods"]["metric"]["name"] for metric in hpas["prefill"]["spec"]["metrics"]}
    assert prefill == {"tandem_worker_queued_prefill_tokens"}


def test_the_adapter_serves_every_autoscaler_metric_from_exported_series() -> None:
    rules = values("prometheus-adapter-values.yaml")["rules"]
    served = {}
    for rule in rules["custom"]:
        series = rule["seriesQuery"].split("{")[0]
        assert re.fullmatch(rule["name"]["matches"].strip("^$"), series), rule["name"]
        assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
        assert "<<.LabelMatchers>>" in rule["metricsQuery"] and "<<.GroupBy>>" in rule["metricsQuery"]
        served[rule["name"]["as"]] = rule
        for metric in re.findall(r"tandem_\w+", rule["metricsQuery"] + rule["seriesQuery"]):
            assert is_exported(metric), f"{metric}: no service exports it"
    for hpa in _hpas():
        for metric in hpa["spec"]["metrics"]:
            assert metric["pods"]["metric"]["name"] in served


def test_alerts_are_the_same_in_compose_and_kubernetes_and_use_exported_metrics() -> None:
    compose_groups = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yml").read_text())["groups"]
    (rule,) = load_objects(K8S / "overlays" / "gpu" / "alerts.yaml")
    assert rule["spec"]["groups"] == compose_groups
    expressions = [alert["expr"] for group in compose_groups for alert in group["rules"]]
    assert any("tandem_worker_kv_cache_usage_ratio" in expr and "> 0.9" in expr for expr in expressions)
    for expr in expressions:
        for metric in re.findall(r"tandem_\w+", expr):
            assert is_exported(metric), f"{metric}: no service exports it"


def test_is_exported_knows_a_metric_from_a_made_up_one() -> None:
    assert is_exported("tandem_worker_queue_wait_seconds_bucket")
    assert not is_exported("tandem_worker_made_up_ratio")


def test_redis_serves_tls_with_cert_managers_certificate_and_the_services_ask_the_sentinels_over_tls(settings: dict[str, str]) -> None:
    redis = values("redis-values.yaml")
    tls = redis["tls"]
    assert tls["enabled"] is True and tls["authClients"] is False  # the ACL passwords log clients in
    (certificate,) = [
        c for c in yaml.safe_load_all((K8S / "tls" / "certificates.yaml").read_text()) if c["spec"]["secretName"] == tls["existingSecret"]
    ]
    namespace = secret_generator("tandem-redis")["namespace"]
    assert certificate["metadata"]["namespace"] == namespace, "the chart mounts a Secret of its own namespace"
    assert (tls["certFilename"], tls["certKeyFilename"], tls["certCAFilename"]) == ("tls.crt", "tls.key", "ca.crt")  # cert-manager's keys
    names = certificate["spec"]["dnsNames"]
    sentinels_host = settings["TANDEM_REDIS_SENTINELS"].rsplit(":", 1)[0]
    assert sentinels_host in names, "the services check the sentinels' Service by the name they dial"
    assert redis["sentinel"]["useHostnames"] is True and f"*.redis-headless.{namespace}.svc.cluster.local" in names
    url = settings["TANDEM_REDIS_URL"]
    assert url.startswith(f"rediss://{sentinels_host}:") and url.endswith(f"?ssl_ca_certs={settings['TANDEM_TLS_CA_FILE']}")
