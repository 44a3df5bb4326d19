"""docker-compose.yml's credentials and monitoring: each service gets only its role's
credentials, all from the env file `tandem secrets` writes (never written in the file); NATS,
Redis and Cassandra require them; Prometheus scrapes every service and Grafana shows its
provisioned dashboards. (tests/unit/test_containers.py checks the images and the rest.)"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import redis
import yaml
from compose_cli import MISSING, compose_command
from helpers import wait_until

from tandem.bus.permissions import COMPOSE_INSTANCES, CONTAINER_TLS_FOLDER, cert_user
from tandem.config import DEFAULT_HTTP_PORTS, ROLES
from tandem.devstack.certs import make_cert_set
from tandem.devstack.proc import free_port
from tandem.devstack.redis_listen import supports_tls
from tandem.devstack.secrets import CASSANDRA_APP_PASSWORD, CASSANDRA_PASSWORD, StackSecrets, redis_password_variable, write_container_set
from tandem.devstack.servers import nats_server_binary, redis_server_binary
from tandem.redis_acl import ROLES as REDIS_ROLES
from tandem.redis_acl import binary_version, can_read_only, config_lines
from tandem.runtime.ops_port import OPS_PORT_OFFSET
from tandem.store.cassandra_roles import APP_ROLE

ROOT = Path(__file__).resolve().parents[3]
_REFERENCE = re.compile(r"^\$\{(?P<name>\w+):\?run tandem secrets[^}]*\}$")
_CREDENTIAL_NAME = re.compile(r"PASSWORD|SECRET|_AUTH$")
# The credentials each role is given, under the names its settings read: variable -> source.
# No bus password: each logs in to NATS with its instance's certificate.
ROLE_CREDENTIALS = {
    "chat": {"TANDEM_REDIS_PASSWORD", "TANDEM_CASSANDRA_PASSWORD"},
    "relay": {"TANDEM_REDIS_PASSWORD", "TANDEM_CASSANDRA_PASSWORD"},
    "router": {"TANDEM_INTERNAL_SECRET"},
    "prefill": {"TANDEM_INTERNAL_SECRET"},
    "decode": {"TANDEM_INTERNAL_SECRET"},
}


@pytest.fixture(scope="module")
def services() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]


def references(environment: dict[str, str]) -> dict[str, str]:
    """The credential settings of a service's environment -> the generated variable each names."""
    found = {}
    for name, value in environment.items():
        if _CREDENTIAL_NAME.search(name):
            match = _REFERENCE.match(str(value))
            assert match, f"{name}: {value!r} is not taken from the generated file"
            found[name] = match["name"]
    return found


def test_each_service_gets_its_own_role_credentials_and_no_others(services: dict) -> None:
    for role in ROLES:
        environment = services[role]["environment"]
        credentials = references(environment)
        assert set(credentials) == ROLE_CREDENTIALS[role], role
        assert "TANDEM_NATS_USER" not in environment, role
        (instance,) = [i for i in COMPOSE_INSTANCES if i.role == role]
        assert environment["TANDEM_INSTANCE_ID"] == instance.instance_id
        assert environment["TANDEM_TLS_CERT_FILE"] == f"/etc/tandem/tls/{instance.instance_id}.pem", (
            f"{role}: not its instance's certificate"
        )
        assert credentials.get("TANDEM_INTERNAL_SECRET", "TANDEM_INTERNAL_SECRET") == "TANDEM_INTERNAL_SECRET", role
        if "TANDEM_REDIS_PASSWORD" in credentials:  # its own ACL user's, never the admin's
            assert environment["TANDEM_REDIS_USERNAME"] == role
            assert credentials["TANDEM_REDIS_PASSWORD"] == redis_password_variable(role)
        if "TANDEM_CASSANDRA_PASSWORD" in credentials:  # the application role's, never the superuser's
            assert environment["TANDEM_CASSANDRA_USERNAME"] == APP_ROLE
            assert credentials["TANDEM_CASSANDRA_PASSWORD"] == CASSANDRA_APP_PASSWORD
            assert services[role]["depends_on"]["store-migrate"] == {"condition": "service_completed_successfully"}, role


_LITERAL_PASSWORD_ARGUMENT = re.compile(r"(requirepass|--password|-p)\s+(?![\"']?\$\$)\S")


def test_no_credential_is_written_in_the_file(services: dict) -> None:
    for name, service in services.items():
        references(service.get("environment", {}))  # every credential-named setting is a reference
        commands = [service.get("command", []), service.get("healthcheck", {}).get("test", [])]
        text = " ".join(part for command in commands for part in (command if isinstance(command, list) else [command]))
        assert not _LITERAL_PASSWORD_ARGUMENT.search(text), f"{name}: {text}"
    assert _LITERAL_PASSWORD_ARGUMENT.search("cqlsh -u cassandra -p cassandra")
    assert not _LITERAL_PASSWORD_ARGUMENT.search('cqlsh -u cassandra -p "$$TANDEM_CASSANDRA_PASSWORD"')


def test_nats_has_a_user_per_compose_instance_mapped_from_its_certificate(services: dict) -> None:
    nats = services["nats"]
    config = nats["command"][nats["command"].index("-c") + 1]
    assert f"./deploy/nats/nats.conf:{config}:ro" in nats["volumes"]
    assert "environment" not in nats, "no bus password for the server to read"
    text = (ROOT / "deploy" / "nats" / "nats.conf").read_text()
    assert "verify_and_map: true" in text and "password" not in text
    for instance in COMPOSE_INSTANCES:
        assert f'{{user: "{cert_user(instance)}", permissions: {{' in text


def test_redis_requires_the_password_and_its_healthcheck_logs_in(services: dict) -> None:
    redis = services["redis"]
    script = redis["command"][-1]
    assert script.startswith("exec redis-server - ") and "requirepass $$TANDEM_REDIS_PASSWORD" in script
    roles = {redis_password_variable(role): redis_password_variable(role) for role in REDIS_ROLES}
    assert references(redis["environment"]) == {
        "TANDEM_REDIS_PASSWORD": "TANDEM_REDIS_PASSWORD",
        "REDISCLI_AUTH": "TANDEM_REDIS_PASSWORD",
        **roles,
    }
    assert "grep -q PONG" in redis["healthcheck"]["test"][1]


def test_redis_users_are_the_ones_tandem_redis_acl_makes(services: dict) -> None:
    """Compose runs redis:7, so the chat's log pattern is read-only (`%R~`) there."""
    assert services["redis"]["image"] == "redis:7"
    script = services["redis"]["command"][-1]
    users = [line.strip() for line in script.splitlines() if line.strip().startswith("user ")]
    assert users == config_lines({role: f"$${redis_password_variable(role)}" for role in REDIS_ROLES}, can_read_only=True)


def test_redis_has_a_memory_limit_and_never_evicts(services: dict) -> None:
    script = services["redis"]["command"][-1]
    assert "--maxmemory-policy noeviction" in script and "--maxmemory ${TANDEM_REDIS_MAXMEMORY:-" in script
    helm = yaml.safe_load((ROOT / "deploy" / "helm" / "redis-values.yaml").read_text())["commonConfiguration"].splitlines()
    assert "maxmemory-policy noeviction" in helm and any(line.startswith("maxmemory ") for line in helm)


def test_cassandra_turns_password_authentication_on(services: dict) -> None:
    cassandra = services["cassandra"]
    (mount,) = [volume for volume in cassandra["volumes"] if volume.startswith("./")]
    source, target, _ = mount.split(":")
    assert cassandra["entrypoint"] == ["/bin/sh", target]
    script = (ROOT / source).read_text()
    assert "s/AllowAllAuthenticator/PasswordAuthenticator/" in script
    assert "s/AllowAllAuthorizer/CassandraAuthorizer/" in script  # grants count
    assert "ALTER ROLE cassandra WITH PASSWORD" in script
    assert "docker-entrypoint.sh cassandra -f" in script  # the image's own start
    # The commit log is synced before a write is acknowledged, in k8s as in compose (below).
    (cluster,) = yaml.safe_load_all((ROOT / "deploy" / "k8s" / "data" / "cassandra.yaml").read_text())
    (datacenter,) = cluster["spec"]["cassandra"]["datacenters"]
    assert datacenter["config"]["cassandraYaml"]["commitlog_sync"] == "batch"
    assert references(cassandra["environment"]) == {"TANDEM_CASSANDRA_PASSWORD": "TANDEM_CASSANDRA_PASSWORD"}
    assert "$$TANDEM_CASSANDRA_PASSWORD" in cassandra["healthcheck"]["test"][1]


def test_every_cassandra_client_verifies_the_node_against_the_tls_volumes_ca(services: dict) -> None:
    clients = [name for name, service in services.items() if service.get("environment", {}).get("TANDEM_STORE") == "cassandra"]
    assert sorted(clients) == ["chat", "relay", "store-migrate"]
    for name in clients:
        assert services[name]["environment"]["TANDEM_CASSANDRA_CA_FILE"] == "/etc/tandem/tls/ca.pem", name
        assert "tls:/etc/tandem/tls:ro" in services[name]["volumes"], name
    assert "tls:/etc/tandem/tls:ro" in services["cassandra"]["volumes"]
    assert "cqlsh --ssl " in services["cassandra"]["healthcheck"]["test"][1]


def test_every_mounted_file_is_in_the_repo(services: dict) -> None:
    mounts = [volume for service in services.values() for volume in service.get("volumes", []) if volume.startswith("./")]
    assert len(mounts) >= 6
    for mount in mounts:
        assert (ROOT / mount.split(":")[0]).exists(), mount


def test_tandem_secrets_writes_every_variable_compose_requires(tmp_path: Path) -> None:
    write_container_set(tmp_path, StackSecrets.generate(), is_overwrite=False)
    written = dict(line.split("=", 1) for line in (tmp_path / "tandem.env").read_text().splitlines())
    required = set(re.findall(r"\$\{(\w+):\?run tandem secrets", (ROOT / "docker-compose.yml").read_text()))
    assert required and required <= set(written), required - set(written)
    compose = compose_command()
    if compose is None:
        pytest.skip(f"checked the variables only: {MISSING}")
    env = {name: value for name, value in os.environ.items() if name not in required} | {"TANDEM_API_KEYS": "k=u:plus"}
    command = [*compose, "--env-file", str(tmp_path / "tandem.env"), "-f", "docker-compose.yml", "config", "--quiet"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr


def test_prometheus_scrapes_every_service_on_its_ops_port(services: dict) -> None:
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == set(ROLES)
    for role, job in jobs.items():
        (discovery,) = job["dns_sd_configs"]
        assert discovery["names"] == [role] and role in services  # every replica of the compose service
        assert discovery["port"] == DEFAULT_HTTP_PORTS[role] + OPS_PORT_OFFSET
        assert job.get("metrics_path", "/metrics") == "/metrics"
    mounted = {volume.split(":")[1] for volume in services["prometheus"]["volumes"] if volume.startswith("./")}
    assert set(config["rule_files"]) <= mounted


def test_grafana_is_provisioned_with_prometheus_and_the_dashboards_folder(services: dict) -> None:
    grafana = services["grafana"]
    mounts = dict(volume.split(":")[:2] for volume in grafana["volumes"] if volume.startswith("./"))
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    provisioning = ROOT / "deploy" / "grafana" / "provisioning"
    (source,) = [s for path in (provisioning / "datasources").glob("*.yml") for s in yaml.safe_load(path.read_text())["datasources"]]
    assert source["uid"] == "prometheus" and source["type"] == "prometheus"
    assert source["url"] == "http://prometheus:9090" and "127.0.0.1:9090:9090" in services["prometheus"]["ports"]
    (provider,) = [p for path in (provisioning / "dashboards").glob("*.yml") for p in yaml.safe_load(path.read_text())["providers"]]
    assert mounts["./deploy/grafana/dashboards"] == provider["options"]["path"]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith(provider["options"]["path"] + "/")
    assert (ROOT / "deploy" / "grafana" / "dashboards" / Path(home).name).is_file(), home
    for dashboard in (ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"):
        named = set(re.findall(r'"datasource":\s*\{[^{}]*"uid":\s*"([^"$]+)"', dashboard.read_text()))
        assert named == {source["uid"]}, f"{dashboard.name} names data sources Grafana does not have: {named}"
    assert grafana["environment"]["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"  # anonymous visitors only look
    assert grafana["environment"]["GF_AUTH_DISABLE_LOGIN_FORM"] == "true"


def test_nats_server_accepts_the_compose_command_with_the_generated_certificates(services: dict, tmp_path: Path) -> None:
    nats = services["nats"]
    mounts = {volume.split(":")[1]: volume.split(":")[0] for volume in nats["volumes"] if volume.startswith("./")}
    certs = make_cert_set(tmp_path / "set", instances=COMPOSE_INSTANCES)  # where the tls volume has them: the certs service copies DIR/tls
    config = (ROOT / mounts[nats["command"][nats["command"].index("-c") + 1]]).read_text()
    assert config.count(CONTAINER_TLS_FOLDER + "/") == 3, "compose's NATS takes clients without TLS"
    (tmp_path / "nats.conf").write_text(config.replace(CONTAINER_TLS_FOLDER + "/", f"{certs.folder}/"))
    command = [str(tmp_path / "nats.conf") if word in mounts else word for word in nats["command"]]
    command[command.index("-sd") + 1] = str(tmp_path / "data")
    env = {name: value for name, value in os.environ.items() if not name.startswith("TANDEM_")}
    checked = subprocess.run([nats_server_binary(), *command, "-t"], capture_output=True, text=True, env=env, timeout=60)
    assert checked.returncode == 0, checked.stderr
    for instance in COMPOSE_INSTANCES:
        assert certs.cert_file(instance.instance_id).is_file(), "tandem secrets issues each compose instance its certificate"


async def test_redis_started_as_compose_starts_it_refuses_all_but_the_password(services: dict, tmp_path: Path) -> None:
    """Compose's own command, with the real redis-server (on a free port, data in tmp_path)."""
    shell, flag, script = services["redis"]["command"]
    port = free_port()
    binary = redis_server_binary()
    script = script.replace("$$", "$").replace("exec redis-server ", f"exec {binary} ", 1)
    assert "--port 0 --tls-port 6379 " in script, "compose's Redis has a plaintext port"
    if supports_tls(binary):  # its TLS port alone, with the certificates `tandem secrets` writes
        certs = make_cert_set(tmp_path)
        script = script.replace("/etc/tandem/tls/", f"{certs.folder}/").replace("--tls-port 6379", f"--tls-port {port}")
        script = script.replace("--dir /data", f"--dir {tmp_path} --bind 127.0.0.1", 1)
        tls = {"ssl": True, "ssl_ca_certs": str(certs.ca_file)}
    else:  # the embedded redis-server has no TLS (tests/integration/test_redis_listen.py): the rest on a plaintext port
        script = re.sub(r" --tls-[a-z-]+ \S+", "", script).replace("--dir /data", f"--dir {tmp_path} --port {port} --bind 127.0.0.1", 1)
        tls = {}
    if not can_read_only(binary_version(binary)):  # Redis 6 here: what redis_acl leaves out for it
        script = script.replace("%R~", "~").replace(" -function", "")
    password = "stand-in-password"
    role_passwords = {role: f"stand-in-{role}" for role in REDIS_ROLES}
    env = {"PATH": os.environ.get("PATH", ""), "TANDEM_REDIS_PASSWORD": password}
    env |= {redis_password_variable(role): value for role, value in role_passwords.items()}
    server = subprocess.Popen([shell, flag, script], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    anonymous = redis.asyncio.Redis(port=port, **tls)
    logged_in = redis.asyncio.Redis(port=port, password=password, **tls)
    chat = redis.asyncio.Redis(port=port, username="chat", password=role_passwords["chat"], **tls)
    try:

        async def answers() -> bool:
            try:
                return bool(await logged_in.ping())
            except redis.ConnectionError:
                return False

        await wait_until(answers, timeout_s=20)
        with pytest.raises(redis.AuthenticationError):
            await anonymous.ping()
        assert await logged_in.config_get("appendonly") == {"appendonly": "yes"}  # the rest of the command applies
        assert await chat.set("tandem:idempotency:u:d", "r", ex=60)  # the chat's own user, from its variable
        with pytest.raises(redis.exceptions.NoPermissionError):
            await chat.flushall()
        with pytest.raises(redis.exceptions.NoPermissionError):
            await chat.get("tandem:replies:unpersisted")
    finally:
        await chat.aclose()
        await anonymous.aclose()
        await logged_in.aclose()
        server.terminate()
        server.wait(timeout=20)


# The shape of the image's block (Cassandra 5.0's cassandra.yaml): replaced whole by the entrypoint.
IMAGE_CLIENT_ENCRYPTION = """client_encryption_options:
  # Enable client-to-server encryption
  enabled: false
  # optional: true
  keystore: conf/.keystore
  keystore_password: cassandra
  # cipher_suites: [TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384]

# internode_compression controls whether traffic between nodes is compressed.
internode_compression: dc
"""


@pytest.mark.parametrize(
    "setting",
    [
        "authenticator: AllowAllAuthenticator\n",
        "authenticator:\n  class_name : org.apache.cassandra.auth.AllowAllAuthenticator\n",
    ],
)
def test_cassandra_entrypoint_switches_either_spelling_of_the_authenticator(services: dict, tmp_path: Path, setting: str) -> None:
    """The script up to where it starts the image's entrypoint, which is not here: it must have
    switched the setting (comments untouched) and the commit log to batch mode (the period it
    refuses commented out), and then stop with an error, not wait forever."""
    (mount,) = [volume for volume in services["cassandra"]["volumes"] if volume.startswith("./")]
    comment = "# authenticator: AllowAllAuthenticator is the default\n"
    commit_log = "commitlog_sync: periodic\ncommitlog_sync_period: 10000ms\n"
    (tmp_path / "cassandra.yaml").write_text(comment + setting + commit_log + IMAGE_CLIENT_ENCRYPTION + "authorizer: AllowAllAuthorizer\n")
    env = {"PATH": "/usr/bin:/bin", "CASSANDRA_CONF": str(tmp_path), "TANDEM_CASSANDRA_PASSWORD": "stand-in"}
    env |= {"SSL_CERTFILE": services["cassandra"]["environment"]["SSL_CERTFILE"]}
    result = subprocess.run(["/bin/sh", str(ROOT / mount.split(":")[0])], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "cassandra exited before its password was set" in result.stderr
    expected = setting.replace("AllowAllAuthenticator", "PasswordAuthenticator")
    batch = "commitlog_sync: batch\n# commitlog_sync_period: 10000ms\n"
    edited = (tmp_path / "cassandra.yaml").read_text()
    kept = "internode_compression: dc\n"  # the key after the image's block
    assert edited.startswith(comment + expected + batch + kept + "authorizer: CassandraAuthorizer\n"), edited
    assert edited.count("client_encryption_options:") == 1, edited
    assert yaml.safe_load(edited)["client_encryption_options"] == {
        "enabled": True,
        "optional": False,  # a plaintext client is refused
        "ssl_context_factory": {"class_name": "org.apache.cassandra.security.PEMBasedSslContextFactory"},
        "keystore": "/etc/tandem/tls/cassandra-keystore.pem",  # the certs service writes it
        "truststore": "/etc/tandem/tls/ca.pem",
    }


def test_cassandra_entrypoint_refuses_to_start_without_a_password(services: dict, tmp_path: Path) -> None:
    (mount,) = [volume for volume in services["cassandra"]["volumes"] if volume.startswith("./")]
    env = {"PATH": "/usr/bin:/bin", "CASSANDRA_CONF": str(tmp_path)}
    result = subprocess.run(["/bin/sh", str(ROOT / mount.split(":")[0])], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "TANDEM_CASSANDRA_PASSWORD" in result.stderr


def test_store_migrate_runs_as_the_cassandra_superuser_and_hands_the_role_its_password(services: dict) -> None:
    migrate = services["store-migrate"]
    assert migrate["command"] == ["python", "-m", "tandem.ops.store_migrate"]
    environment = migrate["environment"]
    assert (environment["TANDEM_STORE"], environment["TANDEM_CASSANDRA_USERNAME"]) == ("cassandra", "cassandra")
    assert references(environment) == {CASSANDRA_PASSWORD: CASSANDRA_PASSWORD, CASSANDRA_APP_PASSWORD: CASSANDRA_APP_PASSWORD}
    assert migrate["depends_on"] == {"cassandra": {"condition": "service_healthy"}}
    assert migrate["build"]["target"] in {"chat", "relay"}  # the images with the Cassandra driver


def test_bus_init_runs_as_the_operator_before_every_service(services: dict) -> None:
    init = services["bus-init"]
    assert init["command"] == ["python", "-m", "tandem.ops.bus_init"]
    assert "TANDEM_NATS_USER" not in init["environment"] and not references(init["environment"])
    assert init["environment"]["TANDEM_TLS_CERT_FILE"] == "/etc/tandem/tls/operator.pem", "the operator's certificate is its login"
    assert init["depends_on"]["nats"] == {"condition": "service_healthy"}
    for role in ROLES:
        assert services[role]["depends_on"]["bus-init"] == {"condition": "service_completed_successfully"}, role
