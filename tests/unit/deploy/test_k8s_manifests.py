"""deploy/k8s renders (without kustomize: kustomize_lite) into objects that pass the Kubernetes
schemas (kubernetes-validate, offline) and do what a fleet needs: probes on /healthz and /readyz,
a grace period longer than the drain, resource requests, disruption budgets and autoscalers for
the workers, only chat reachable from outside, and each role's credentials from its own Secret."""

from __future__ import annotations

import base64
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kustomize_lite import Object, load_objects, render

from tandem.bus.permissions import K8S_POOL_SIZES, OPERATOR_CERT_USER, Identity, cert_user
from tandem.config import DEFAULT_GRPC_PORTS, DEFAULT_HTTP_PORTS, ROLES, ApiKey, Tier
from tandem.devstack.secrets import StackSecrets, write_container_set
from tandem.key_file import entry_for, generate_key, key_id_of, parse_key_file
from tandem.runtime.ops_port import OPS_PORT_OFFSET
from tandem.store.cassandra_roles import APP_ROLE
from tandem.tls import server_name

ROOT = Path(__file__).resolve().parents[3]
K8S = ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.33"  # the oldest release the manifests target; its schemas ship with kubernetes-validate
WORKERS = ("prefill", "decode")
# The kinds whose schemas come from CRDs (checked by the structural tests below instead).
CUSTOM_KINDS = {"PodMonitor", "PrometheusRule"}
K8S_KEY = generate_key()
# What each role's Secret holds: its own credentials and nothing else.
ROLE_SECRET_KEYS = {
    "chat": {
        "TANDEM_REDIS_PASSWORD",
        "TANDEM_REDIS_SENTINEL_PASSWORD",
        "TANDEM_CASSANDRA_PASSWORD",
    },
    "relay": {"TANDEM_REDIS_PASSWORD", "TANDEM_REDIS_SENTINEL_PASSWORD", "TANDEM_CASSANDRA_PASSWORD"},
    "router": {"TANDEM_INTERNAL_SECRET"},
    "prefill": {"TANDEM_INTERNAL_SECRET"},
    "decode": {"TANDEM_INTERNAL_SECRET"},
}


def by_kind(objects: list[Object], kind: str) -> dict[str, Object]:
    return {item["metadata"]["name"]: item for item in objects if item["kind"] == kind}


def container(deployment: Object) -> Object:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


@pytest.fixture(scope="module")
def base() -> list[Object]:
    return render(K8S / "base")


@pytest.fixture(scope="module")
def gpu() -> list[Object]:
    return render(K8S / "overlays" / "gpu")


@pytest.fixture(scope="module")
def secret_set() -> StackSecrets:
    return StackSecrets.generate()


@pytest.fixture(scope="module")
def secrets_folder(tmp_path_factory: pytest.TempPathFactory, secret_set: StackSecrets) -> Path:
    """deploy/k8s/secrets with what `tandem secrets .../generated` writes, plus the API keys."""
    folder = tmp_path_factory.mktemp("k8s") / "secrets"
    shutil.copytree(K8S / "secrets", folder)
    write_container_set(folder / "generated", secret_set, is_overwrite=False)
    (folder / "generated" / "api-keys").write_text(entry_for(K8S_KEY, ApiKey("ops", Tier.PRO)).line() + "\n")
    return folder


@pytest.fixture(scope="module")
def secrets(secrets_folder: Path) -> list[Object]:
    return render(secrets_folder)


@pytest.fixture(scope="module", params=["base", "gpu"])
def rendered(request: pytest.FixtureRequest, base: list[Object], gpu: list[Object]) -> list[Object]:
    return {"base": base, "gpu": gpu}[request.param]


def test_every_object_passes_the_kubernetes_schema(base: list[Object], gpu: list[Object], secrets: list[Object]) -> None:
    checked = 0
    for item in [*base, *gpu, *secrets]:
        if item["kind"] in CUSTOM_KINDS:
            continue
        name = f"{item['kind']}/{item['metadata']['name']}"
        try:
            kubernetes_validate.validate(item, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            path = ".".join(str(part) for part in error.path)
            pytest.fail(f"{name}: {path}: {error.message}")
        checked += 1
    assert checked >= 40


def test_the_schema_check_catches_a_misspelt_field(base: list[Object]) -> None:
    deployment = by_kind(base, "StatefulSet")["chat"]
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def _kubectl_kustomize(folder: Path) -> list[Object]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    result = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return [item for item in yaml.safe_load_all(result.stdout) if item]


def _keyed(objects: list[Object]) -> dict[tuple[str, str, str], Object]:
    return {(item["kind"], item["metadata"].get("namespace", ""), item["metadata"]["name"]): item for item in objects}


@pytest.mark.parametrize("folder", ["base", "overlays/gpu", "secrets"])
def test_renders_what_kubectl_kustomize_renders(folder: str, secrets_folder: Path) -> None:
    path = secrets_folder if folder == "secrets" else K8S / folder
    assert _keyed(render(path)) == _keyed(_kubectl_kustomize(path))


def test_a_deployment_and_service_per_role_from_its_dockerfile_target(rendered: list[Object]) -> None:
    deployments, services = by_kind(rendered, "StatefulSet"), by_kind(rendered, "Service")
    assert set(deployments) == set(services) == set(ROLES)
    dockerfile = (ROOT / "Dockerfile").read_text()
    for role in ROLES:
        assert f" AS {role}\n" in dockerfile
        image = container(deployments[role])["image"]
        assert image.rsplit(":", 1)[0].replace("/", "-").endswith(f"tandem-{role}"), image
        assert image.rsplit(":", 1)[1], f"{role}: no tag"
        ports = {port["name"]: port["containerPort"] for port in container(deployments[role])["ports"]}
        assert ports["http"] == DEFAULT_HTTP_PORTS[role]
        assert ports["ops"] == DEFAULT_HTTP_PORTS[role] + OPS_PORT_OFFSET, "the image's TANDEM_OPS_PORT"
        assert "ops" not in [port["targetPort"] for port in services[role]["spec"]["ports"]], f"{role}: its Service has no ops port"
        if role in DEFAULT_GRPC_PORTS:
            assert ports["grpc"] == DEFAULT_GRPC_PORTS[role]
        assert services[role]["spec"]["selector"] == deployments[role]["spec"]["template"]["metadata"]["labels"]
        assert services[role]["spec"].get("type", "ClusterIP") == "ClusterIP", f"{role} exposed by its Service"


def test_probes_ask_readyz_and_healthz_on_the_ops_port(rendered: list[Object]) -> None:
    for role, deployment in by_kind(rendered, "StatefulSet").items():
        probes = container(deployment)
        assert probes["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "ops"}, role
        assert probes["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "ops"}, role
        if "startupProbe" in probes:
            assert probes["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "ops"}, role


def _setting(objects: list[Object], name: str) -> float:
    return float(by_kind(objects, "ConfigMap")["tandem-settings"]["data"][name])


def test_grace_period_outlasts_the_drain_and_the_shutdown(rendered: list[Object]) -> None:
    drain_s = _setting(rendered, "TANDEM_DRAIN_TIMEOUT_S")
    shutdown_s = _setting(rendered, "TANDEM_SHUTDOWN_TIMEOUT_S")
    for role, deployment in by_kind(rendered, "StatefulSet").items():
        pod = deployment["spec"]["template"]["spec"]
        pre_stop = container(deployment).get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        pre_stop_s = float(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0.0
        needed_s = pre_stop_s + shutdown_s + (drain_s if role in WORKERS else 0.0)
        assert pod["terminationGracePeriodSeconds"] > needed_s, role


def test_every_container_requests_cpu_and_memory(rendered: list[Object]) -> None:
    for role, deployment in by_kind(rendered, "StatefulSet").items():
        requests = container(deployment)["resources"]["requests"]
        assert {"cpu", "memory"} <= set(requests), role
        assert "memory" in container(deployment)["resources"]["limits"], role


def test_gpu_workers_get_a_gpu_per_rank_and_the_rest_none(base: list[Object], gpu: list[Object]) -> None:
    for role, deployment in by_kind(gpu, "StatefulSet").items():
        resources = container(deployment)["resources"]
        if role in WORKERS:
            env = {item["name"]: item.get("value") for item in container(deployment)["env"]}
            num_ranks = int(env["TANDEM_TENSOR_PARALLEL_SIZE"])
            assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == num_ranks, role
            assert env["TANDEM_DEVICE"] == "cuda"
            assert float(env["TANDEM_WORKER_HOUR_COST"]) > 0  # the dashboard's cost per Mtok
        else:
            assert "nvidia.com/gpu" not in resources["requests"], role
    for deployment in by_kind(base, "StatefulSet").values():
        assert "nvidia.com/gpu" not in container(deployment)["resources"]["requests"]


def test_workers_have_a_disruption_budget(rendered: list[Object]) -> None:
    deployments = by_kind(rendered, "StatefulSet")
    budgets = by_kind(rendered, "PodDisruptionBudget").values()
    for role in WORKERS:
        labels = deployments[role]["spec"]["template"]["metadata"]["labels"]
        matching = [b for b in budgets if b["spec"]["selector"]["matchLabels"].items() <= labels.items()]
        assert len(matching) == 1, role
        assert matching[0]["spec"].get("maxUnavailable") == 1 or matching[0]["spec"].get("minAvailable"), role


def test_pods_run_restricted(rendered: list[Object]) -> None:
    for role, deployment in by_kind(rendered, "StatefulSet").items():
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, role
        security = container(deployment)["securityContext"]
        assert security["allowPrivilegeEscalation"] is False and security["capabilities"]["drop"] == ["ALL"], role


def _env(deployment: Object) -> dict[str, Any]:
    return {item["name"]: item.get("value", item.get("valueFrom")) for item in container(deployment).get("env", [])}


def test_each_role_takes_its_own_secret_which_holds_its_credentials_only(
    rendered: list[Object], secrets: list[Object], secret_set: StackSecrets
) -> None:
    assert not by_kind(rendered, "Secret"), "credentials belong in deploy/k8s/secrets, from tandem secrets"
    generated = {s["metadata"]["name"]: s for s in secrets if s["kind"] == "Secret"}
    for role, deployment in by_kind(rendered, "StatefulSet").items():
        sources = container(deployment)["envFrom"]
        assert {"configMapRef": {"name": "tandem-settings"}} in sources
        secret_refs = [source["secretRef"]["name"] for source in sources if "secretRef" in source]
        assert secret_refs == [f"tandem-{role}"], role
        secret = generated[f"tandem-{role}"]
        assert secret["metadata"]["namespace"] == deployment["metadata"]["namespace"]
        assert set(secret["data"]) == ROLE_SECRET_KEYS[role], role
        assert "TANDEM_NATS_USER" not in _env(deployment), f"{role}: its certificate is its bus login"
        if "TANDEM_REDIS_PASSWORD" in ROLE_SECRET_KEYS[role]:  # its own ACL user, never the admin's default
            assert _env(deployment)["TANDEM_REDIS_USERNAME"] == role
            password = base64.b64decode(secret["data"]["TANDEM_REDIS_PASSWORD"]).decode()
            assert password == secret_set.redis_passwords[role] != secret_set.redis_password, role
        if "TANDEM_CASSANDRA_PASSWORD" in ROLE_SECRET_KEYS[role]:  # the application role, never the superuser
            assert _env(deployment)["TANDEM_CASSANDRA_USERNAME"] == APP_ROLE
            password = base64.b64decode(secret["data"]["TANDEM_CASSANDRA_PASSWORD"]).decode()
            assert password == secret_set.cassandra_app_password != secret_set.cassandra_password, role


def test_only_the_chat_mounts_the_api_keys_and_they_are_hashes(rendered: list[Object], secrets: list[Object]) -> None:
    keys_secret = next(s for s in secrets if s["kind"] == "Secret" and s["metadata"]["name"] == "tandem-chat-api-keys")
    held = base64.b64decode(keys_secret["data"]["api-keys"]).decode()
    entries, problems = parse_key_file(held)
    assert not problems and entries[key_id_of(K8S_KEY)].matches(K8S_KEY)
    assert K8S_KEY not in held and K8S_KEY.split(".", 1)[1] not in held
    for role, deployment in by_kind(rendered, "StatefulSet").items():
        mounts = [v["secret"]["secretName"] for v in deployment["spec"]["template"]["spec"].get("volumes", []) if "secret" in v]
        if role == "chat":
            assert mounts == ["tandem-chat-api-keys"]
            assert _env(deployment)["TANDEM_API_KEYS_FILE"] == "/etc/tandem/api-keys/api-keys"
        else:  # nor in its Secret: ROLE_SECRET_KEYS
            assert "tandem-chat-api-keys" not in mounts, role
            assert not {"TANDEM_API_KEYS", "TANDEM_API_KEYS_FILE"} & set(_env(deployment)), role


def test_no_manifest_holds_a_literal_credential() -> None:
    for path in [*K8S.rglob("*.yaml"), *(ROOT / "deploy" / "helm").glob("*.yaml")]:
        for item in load_objects(path):
            assert item.get("kind") != "Secret" or not (item.get("data") or item.get("stringData")), path
            for generator in item.get("secretGenerator", []):
                for literal in generator.get("literals", []):
                    assert literal.split("=")[0] in ("username",), f"{path}: {literal.split('=')[0]} written in the file"
    ignored = (K8S / "secrets" / "generated" / ".gitignore").read_text().split()
    assert ignored[-2:] == ["*", "!.gitignore"], "the generated credentials must stay out of git"


def test_only_chat_is_reachable_from_outside(rendered: list[Object]) -> None:
    ingresses = by_kind(rendered, "Ingress")
    backends = {
        (path["backend"]["service"]["name"], path["backend"]["service"]["port"]["name"])
        for ingress in ingresses.values()
        for rule in ingress["spec"]["rules"]
        for path in rule["http"]["paths"]
    }
    assert backends == {("chat", "http")}, "the chat's public port only, never its ops port"
    for name, service in by_kind(rendered, "Service").items():
        assert service["spec"].get("type", "ClusterIP") == "ClusterIP", name
    policies = by_kind(rendered, "NetworkPolicy").values()
    deny = [p for p in policies if p["spec"]["podSelector"] == {} and not p["spec"].get("ingress")]
    assert deny and deny[0]["spec"]["policyTypes"] == ["Ingress"], "no default deny"
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            if "from" not in rule:  # from anywhere
                assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "chat", policy["metadata"]["name"]
                assert [port["port"] for port in rule["ports"]] == [DEFAULT_HTTP_PORTS["chat"]]


def test_prometheus_scrapes_every_pod_on_its_ops_port(gpu: list[Object]) -> None:
    (monitor,) = by_kind(gpu, "PodMonitor").values()
    assert monitor["metadata"]["namespace"] == "tandem"
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["path"], endpoint["port"]) == ("/metrics", "ops")
    for role, deployment in by_kind(gpu, "StatefulSet").items():
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items(), role
        assert endpoint["port"] in {port["name"] for port in container(deployment)["ports"]}, role


def test_gpu_model_readers_mount_the_model_the_settings_name(gpu: list[Object]) -> None:
    model_path = by_kind(gpu, "ConfigMap")["tandem-settings"]["data"]["TANDEM_MODEL_PATH"]
    for role in (*WORKERS, "chat"):
        deployment = by_kind(gpu, "StatefulSet")[role]
        mounts = {mount["name"]: mount for mount in container(deployment)["volumeMounts"]}
        assert mounts["models"]["readOnly"] is True and model_path.startswith(mounts["models"]["mountPath"] + "/"), role
        volumes = {volume["name"]: volume for volume in deployment["spec"]["template"]["spec"]["volumes"]}
        assert volumes["models"]["persistentVolumeClaim"] == {"claimName": "tandem-models", "readOnly": True}, role


def test_every_object_lands_in_the_tandem_namespace(rendered: list[Object]) -> None:
    for item in rendered:
        if item["kind"] != "Namespace":
            assert item["metadata"].get("namespace") == "tandem", f"{item['kind']}/{item['metadata']['name']}"


def test_bus_init_job_runs_as_the_operator_with_a_replica_per_nats_node(
    rendered: list[Object], secrets: list[Object], secret_set: StackSecrets
) -> None:
    job = by_kind(rendered, "Job")["bus-init"]
    pod = job["spec"]["template"]["spec"]
    (init,) = pod["containers"]
    assert init["command"] == ["python", "-m", "tandem.ops.bus_init"]
    env = {item["name"]: item.get("value") for item in init["env"]}
    assert "TANDEM_NATS_USER" not in env, "the operator's certificate is its login"
    nats_nodes = yaml.safe_load((ROOT / "deploy" / "helm" / "nats-values.yaml").read_text())["config"]["cluster"]["replicas"]
    assert int(env["TANDEM_TOKEN_STREAM_REPLICAS"]) == nats_nodes
    assert init["envFrom"] == [{"configMapRef": {"name": "tandem-settings"}}]
    (tls,) = [volume for volume in pod["volumes"] if volume["name"] == "tls"]
    assert tls["secret"]["secretName"] == "tandem-operator-tls"
    operator = {item["spec"]["secretName"]: item for item in yaml.safe_load_all((K8S / "tls" / "certificates.yaml").read_text())}
    assert operator["tandem-operator-tls"]["spec"]["dnsNames"] == [OPERATOR_CERT_USER], "the name NATS maps to the operator"
    assert not [s for s in secrets if s["kind"] == "Secret" and "NATS" in str(s["data"])], "no bus password is handed out"
    assert pod["securityContext"]["runAsNonRoot"] is True and init["securityContext"]["allowPrivilegeEscalation"] is False


def test_store_migrate_job_runs_as_the_cassandra_superuser_and_gives_the_role_its_password(
    rendered: list[Object], secrets: list[Object], secret_set: StackSecrets
) -> None:
    pod = by_kind(rendered, "Job")["store-migrate"]["spec"]["template"]["spec"]
    (migrate,) = pod["containers"]
    assert migrate["command"] == ["python", "-m", "tandem.ops.store_migrate"]
    assert migrate["image"] == container(by_kind(rendered, "StatefulSet")["relay"])["image"]  # it has the Cassandra driver
    generated = {s["metadata"]["name"]: s for s in secrets if s["kind"] == "Secret"}
    superuser = generated["tandem-cassandra-superuser"]["data"]
    assert {item["name"]: item.get("value") for item in migrate["env"]}["TANDEM_CASSANDRA_USERNAME"] == base64.b64decode(
        superuser["username"]
    ).decode()
    assert {"secretRef": {"name": "tandem-store-admin"}} in migrate["envFrom"]
    admin = {name: base64.b64decode(value).decode() for name, value in generated["tandem-store-admin"]["data"].items()}
    assert admin == {
        "TANDEM_CASSANDRA_PASSWORD": secret_set.cassandra_password,
        "TANDEM_CASSANDRA_APP_PASSWORD": secret_set.cassandra_app_password,
    }
    assert base64.b64decode(superuser["password"]).decode() == secret_set.cassandra_password
    assert pod["securityContext"]["runAsNonRoot"] is True and migrate["securityContext"]["allowPrivilegeEscalation"] is False


def _nats_users() -> set[str]:
    values = yaml.safe_load((ROOT / "deploy" / "helm" / "nats-values.yaml").read_text())
    return {user["user"] for user in values["config"]["merge"]["authorization"]["users"]}


def test_each_service_is_a_statefulset_whose_pods_take_their_instance_id_from_their_name(rendered: list[Object]) -> None:
    for role, statefulset in by_kind(rendered, "StatefulSet").items():
        assert statefulset["spec"]["serviceName"] == role and statefulset["spec"]["podManagementPolicy"] == "Parallel", role
        assert _env(statefulset)["TANDEM_INSTANCE_ID"] == {"fieldRef": {"fieldPath": "metadata.name"}}, role
    assert not by_kind(rendered, "Deployment"), "a Deployment's pod names are random: no bus user waits for them"


def test_each_pod_mounts_a_certificate_for_itself_alone_naming_its_bus_user(rendered: list[Object]) -> None:
    """cert-manager's csi-driver issues it when the pod starts, with the pod's name in it: the
    name nats-server maps to that instance's user (tandem.bus.permissions.cert_user)."""
    settings = by_kind(rendered, "ConfigMap")["tandem-settings"]["data"]
    assert (settings["TANDEM_TLS_CA_FILE"], settings["TANDEM_TLS_CERT_FILE"]) == ("/etc/tandem/tls/ca.crt", "/etc/tandem/tls/tls.crt")
    for role, statefulset in by_kind(rendered, "StatefulSet").items():
        pod = statefulset["spec"]["template"]["spec"]
        (tls,) = [volume for volume in pod["volumes"] if volume["name"] == "tls"]
        assert tls["csi"]["driver"] == "csi.cert-manager.io" and tls["csi"]["readOnly"] is True, role
        attributes = tls["csi"]["volumeAttributes"]
        own = cert_user(Identity(role, "POD")).replace("POD", "${POD_NAME}")
        assert attributes["csi.cert-manager.io/common-name"] == own, role
        names = attributes["csi.cert-manager.io/dns-names"].split(",")
        assert names[0] == own and server_name(role) in names, f"{role}: a prefill worker checks {server_name(role)}"
        assert not [name for name in names[1:] if "${POD_NAME}" in name or name in _nats_users()], (
            f"{role}: a second name could map to another user"
        )
        assert (attributes["csi.cert-manager.io/issuer-name"], attributes["csi.cert-manager.io/issuer-kind"]) == (
            "tandem-ca",
            "ClusterIssuer",
        )
        assert (
            "client auth" in attributes["csi.cert-manager.io/key-usages"] and "server auth" in attributes["csi.cert-manager.io/key-usages"]
        )
        assert attributes["csi.cert-manager.io/fs-group"] == str(pod["securityContext"]["fsGroup"]), f"{role} cannot read its key"
        assert {"name": "tls", "mountPath": "/etc/tandem/tls", "readOnly": True} in pod["containers"][0]["volumeMounts"], role


def test_the_nats_user_pool_covers_every_pod_a_statefulset_may_run(gpu: list[Object], base: list[Object]) -> None:
    users = _nats_users()
    hpas = {hpa["spec"]["scaleTargetRef"]["name"]: hpa for hpa in by_kind(gpu, "HorizontalPodAutoscaler").values()}
    for rendered in (base, gpu):
        for role, statefulset in by_kind(rendered, "StatefulSet").items():
            most = hpas[role]["spec"]["maxReplicas"] if role in hpas and rendered is gpu else statefulset["spec"].get("replicas", 1)
            assert {cert_user(Identity(role, f"{role}-{index}")) for index in range(most)} <= users, (
                f"{role}: pod {role}-{most - 1} has no bus user"
            )
    for role, hpa in hpas.items():
        assert hpa["spec"]["scaleTargetRef"]["kind"] == "StatefulSet"
        assert K8S_POOL_SIZES[role] == hpa["spec"]["maxReplicas"], f"{role}: the pool is the autoscaler's maximum"
        assert cert_user(Identity(role, f"{role}-{hpa['spec']['maxReplicas']}")) not in users, f"{role}: users for pods that never run"


def test_role_certificates_are_gone_and_the_operators_and_the_servers_remain() -> None:
    certificates = {item["spec"]["secretName"]: item for item in yaml.safe_load_all((K8S / "tls" / "certificates.yaml").read_text())}
    assert set(certificates) == {"tandem-operator-tls", "nats-tls", "redis-tls"}, "a role's shared certificate would log in as no instance"
    assert "nats.tandem.internal" in certificates["nats-tls"]["spec"]["dnsNames"]  # what every NATS client checks
