"""A real single-node Apache Cassandra 5.0 for development and the integration tests.

cassandra-all and its runtime jars come from Maven Central (`mvn`, into a cache folder outside
the repo); the node runs as a plain JVM (CassandraDaemon) on JDK 17 with a cassandra.yaml this
module writes into the node's folder. Cassandra 5.0 calls System.setSecurityManager, which
throws on JDK 18+, so only a JDK 17 is accepted.

Its CQL port takes TLS clients only (client_encryption_options, not optional): at its first start
the node makes a development CA and its `cassandra` certificate in <node folder>/tls
(tandem.devstack.certs) and keeps them across starts, so a client that trusts
<node folder>/tls/ca.pem (TANDEM_CASSANDRA_CA_FILE, RunningNode.ca_file) keeps trusting it after a
restart. Cassandra reads them as PEM (PEMBasedSslContextFactory): no JKS, no keystore password.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from string import Template

from tandem.devstack.certs import CertSet, make_cert_set
from tandem.devstack.proc import free_port
from tandem.errors import StartupError

CASSANDRA_VERSION = "5.0.8"
TEMPLATES = Path(__file__).parent / "cassandra"
STATE_FILE = "node.json"  # pid and ports of a running node, in its folder
READY_LINE = "Startup complete"  # logged right after the CQL port is bound
SUPERUSER_LINE = "Created default superuser role"  # a new node's first start: its superuser can log in
SUPERUSER = ("cassandra", "cassandra")  # the well-known first superuser: loopback nodes only
KILLED_EXIT_WAIT_S = 30.0  # how long a SIGKILLed node may take to be gone
KEYSTORE_FILE = "cassandra-keystore.pem"  # the node's key and certificate in one file, as PEMBasedSslContextFactory reads them

# conf/jvm17-server.options of Cassandra 5.0: without them "unable to access required classes".
_JPMS_OPTIONS = [
    *("--add-exports", "java.base/jdk.internal.misc=ALL-UNNAMED"),
    *("--add-exports", "java.management.rmi/com.sun.jmx.remote.internal.rmi=ALL-UNNAMED"),
    *("--add-exports", "java.management/com.sun.jmx.remote.security=ALL-UNNAMED"),
    *("--add-exports", "java.rmi/sun.rmi.registry=ALL-UNNAMED"),
    *("--add-exports", "java.rmi/sun.rmi.server=ALL-UNNAMED"),
    *("--add-exports", "java.sql/java.sql=ALL-UNNAMED"),
    *("--add-exports", "java.base/java.lang.ref=ALL-UNNAMED"),
    *("--add-exports", "jdk.unsupported/sun.misc=ALL-UNNAMED"),
    *("--add-exports", "jdk.attach/sun.tools.attach=ALL-UNNAMED"),
    *("--add-opens", "java.base/java.lang.module=ALL-UNNAMED"),
    *("--add-opens", "java.base/jdk.internal.loader=ALL-UNNAMED"),
    *("--add-opens", "java.base/jdk.internal.ref=ALL-UNNAMED"),
    *("--add-opens", "java.base/jdk.internal.reflect=ALL-UNNAMED"),
    *("--add-opens", "java.base/jdk.internal.math=ALL-UNNAMED"),
    *("--add-opens", "java.base/jdk.internal.module=ALL-UNNAMED"),
    *("--add-opens", "java.base/jdk.internal.util.jar=ALL-UNNAMED"),
    *("--add-opens", "jdk.management/com.sun.management.internal=ALL-UNNAMED"),
    *("--add-opens", "java.base/sun.nio.ch=ALL-UNNAMED"),
    *("--add-opens", "java.base/java.io=ALL-UNNAMED"),
    *("--add-opens", "java.base/java.lang.reflect=ALL-UNNAMED"),
    *("--add-opens", "java.base/java.lang=ALL-UNNAMED"),
    *("--add-opens", "java.base/java.util=ALL-UNNAMED"),
    *("--add-opens", "java.base/java.nio=ALL-UNNAMED"),
]


@dataclass(frozen=True)
class NodeConfig:
    node_dir: Path  # data, logs, cassandra.yaml and node.json
    native_port: int = 0  # CQL; 0: a free port
    storage_port: int = 0  # internode; 0: a free port
    heap_mib: int = 512
    is_durable: bool = True  # False: no fsync (a test node: survives a killed JVM, not a power cut)
    start_timeout_s: float = 180.0
    version: str = CASSANDRA_VERSION
    cache_dir: Path = Path.home() / ".cache" / "tandem" / "cassandra"
    java: str | None = None  # a JDK 17 `java`; None: TANDEM_CASSANDRA_JAVA or found


@dataclass(frozen=True)
class RunningNode:
    pid: int
    host: str
    native_port: int
    storage_port: int
    node_dir: Path

    @property
    def hosts(self) -> str:
        """The value for TANDEM_CASSANDRA_HOSTS."""
        return f"{self.host}:{self.native_port}"

    @property
    def ca_file(self) -> str:
        """The value for TANDEM_CASSANDRA_CA_FILE: the CA of the node's certificate."""
        return str(CertSet(self.node_dir / "tls").ca_file)

    def is_alive(self) -> bool:
        """Its process still runs (and the pid was not reused by another program)."""
        try:
            argv = Path(f"/proc/{self.pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return False
        is_ours = f"-Dcassandra.storagedir={self.node_dir.resolve() / 'data'}".encode() in argv
        return is_ours and _pid_alive(self.pid)

    def answers(self, timeout_s: float = 1.0) -> bool:
        try:
            socket.create_connection((self.host, self.native_port), timeout=timeout_s).close()
            return True
        except OSError:
            return False


def java_major_version(java: str) -> int | None:
    try:
        out = subprocess.run([java, "-XshowSettings:properties", "-version"], capture_output=True, text=True, timeout=30).stderr
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"java\.specification\.version = (\d+)", out)
    return int(match[1]) if match else None


def find_java17(explicit: str | None = None) -> str:
    """A JDK 17 `java`: the explicit one, TANDEM_CASSANDRA_JAVA, /usr/lib/jvm/*17*, JAVA_HOME, PATH."""
    chosen = explicit or os.environ.get("TANDEM_CASSANDRA_JAVA")
    if chosen:
        if java_major_version(chosen) != 17:
            raise StartupError(f"{chosen} is not a Java 17 (Cassandra 5.0 runs on JDK 17; 18+ removed what it needs)")
        return chosen
    candidates = sorted(str(p) for p in Path("/usr/lib/jvm").glob("*17*/bin/java"))
    if os.environ.get("JAVA_HOME"):
        candidates.append(str(Path(os.environ["JAVA_HOME"]) / "bin" / "java"))
    on_path = shutil.which("java")
    if on_path:
        candidates.append(on_path)
    for candidate in candidates:
        if Path(candidate).is_file() and java_major_version(candidate) == 17:
            return candidate
    raise StartupError(
        "no JDK 17 found (tried /usr/lib/jvm/*17*, JAVA_HOME, PATH): install openjdk-17-jdk-headless or set TANDEM_CASSANDRA_JAVA"
    )


def fetch_jars(version: str, cache_dir: Path) -> Path:
    """The folder of cassandra-all-<version> and its runtime jars, fetched with mvn once."""
    folder = cache_dir / version
    lib = folder / "target" / "lib"
    done = folder / ".fetched"
    if done.is_file():
        return lib
    mvn = shutil.which("mvn")
    if mvn is None:
        raise StartupError("mvn not found: Cassandra's jars come from Maven Central (install maven)")
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two processes fetching at once wait for one another
        if done.is_file():
            return lib
        shutil.copyfile(TEMPLATES / "pom.xml", folder / "pom.xml")
        result = subprocess.run([mvn, "-B", "-q", "package", f"-Dcassandra.version={version}"], cwd=folder, capture_output=True, text=True)
        if result.returncode != 0 or not list(lib.glob(f"cassandra-all-{version}.jar")):
            tail = "\n".join((result.stdout + result.stderr).splitlines()[-15:])
            raise StartupError(f"mvn could not fetch cassandra-all {version} into {lib}:\n{tail}")
        done.write_text(version)
    return lib


def _die_with_parent() -> None:
    # Between fork and exec: the kernel sends SIGTERM to the node when the starting thread ends.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours is dead too.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _jvm_argv(config: NodeConfig, java: str, lib: Path, yaml_path: Path, logs: Path) -> list[str]:
    jars = sorted(lib.glob("*.jar"))
    jamm = [f"-javaagent:{j}" for j in jars if j.name.startswith("jamm-")][:1]
    # skip_sync: no fsync, but the batch commit log still marks each section, so a killed JVM
    # replays everything it acknowledged. (unsafesystem is not used: it skips flushing schema
    # changes, and a killed node then forgets its new keyspaces and drops their data on replay.)
    no_sync = [] if config.is_durable else ["-Dcassandra.skip_sync=true"]
    return [
        java,
        f"-Xms{config.heap_mib}m",
        f"-Xmx{config.heap_mib}m",
        "-XX:+UseG1GC",
        "-XX:+ExitOnOutOfMemoryError",
        "-Djava.net.preferIPv4Stack=true",
        "-Dchronicle.analytics.disable=true",
        "-Dio.netty.tryReflectionSetAccessible=true",
        "-Djdk.attach.allowAttachSelf=true",
        "-Dcassandra.libjemalloc=-",  # no jemalloc here; "-" skips the preload and its warning
        *_JPMS_OPTIONS,
        *jamm,
        "-Dcassandra-foreground=yes",
        f"-Dcassandra.config=file://{yaml_path}",
        f"-Dcassandra.storagedir={config.node_dir / 'data'}",
        f"-Dcassandra.logdir={logs}",
        f"-Dcassandra.triggers_dir={config.node_dir / 'triggers'}",
        f"-Dlogback.configurationFile={TEMPLATES / 'logback.xml'}",
        "-Dcassandra.skip_wait_for_gossip_to_settle=0",
        "-Dcassandra.ring_delay_ms=1000",
        "-Dcassandra.superuser_setup_delay_ms=0",  # the default 10 s would keep a new node's superuser out
        *no_sync,
        "-cp",
        ":".join(str(j) for j in jars),
        "org.apache.cassandra.service.CassandraDaemon",
    ]


def node_certs(node_dir: Path) -> Path:
    """The node's CA and certificate, made at its first start and kept; returns its keystore."""
    certs = CertSet(node_dir / "tls")
    keystore = certs.folder / KEYSTORE_FILE
    if not keystore.is_file():
        certs = make_cert_set(node_dir, services=("cassandra",))
        key_and_cert = certs.key_file("cassandra").read_bytes() + certs.cert_file("cassandra").read_bytes()
        descriptor = os.open(keystore, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "wb") as out:
            out.write(key_and_cert)
    return keystore


def _wait_ready(process: subprocess.Popen[bytes], system_log: Path, deadline: float, lines: tuple[str, ...]) -> None:
    """Reads system.log as it grows until it holds each of `lines`; the node's exit or the deadline ends it."""
    seen = b""
    while not all(line.encode() in seen for line in lines):
        if process.poll() is not None:
            raise StartupError(f"Cassandra exited at start ({process.returncode})")
        if time.monotonic() > deadline:
            raise StartupError(f"Cassandra did not log {' and '.join(repr(line) for line in lines)} in time")
        if system_log.is_file():
            seen = system_log.read_bytes()
        time.sleep(0.1)  # a bounded poll of the log file: logback gives no other signal


def start_node(config: NodeConfig, *, die_with_parent: bool = True) -> RunningNode:
    """Starts a node in config.node_dir (its data is kept across starts) and waits until CQL answers.
    With die_with_parent the node ends with this thread (test fixtures); without, it runs on
    (`tandem cassandra up`) and node.json lets `stop_node` find it."""
    config = dataclasses.replace(config, node_dir=config.node_dir.resolve())  # the JVM's cwd differs
    java = find_java17(config.java)
    lib = fetch_jars(config.version, config.cache_dir)
    existing = read_state(config.node_dir)
    if existing is not None and existing.is_alive():
        raise StartupError(f"a node already runs from {config.node_dir} (pid {existing.pid}, CQL {existing.hosts})")
    host = "127.0.0.1"
    native_port = config.native_port or free_port(host)
    storage_port = config.storage_port or free_port(host)
    for port in (native_port, storage_port):
        with socket.socket() as probe:
            if probe.connect_ex((host, port)) == 0:
                raise StartupError(f"{host}:{port} is already taken by another process")
    logs = config.node_dir / "logs"
    is_new = not (config.node_dir / "data").is_dir()  # its superuser is made after CQL opens
    for sub in (logs, config.node_dir / "data", config.node_dir / "triggers"):
        sub.mkdir(parents=True, exist_ok=True)
    yaml_path = (config.node_dir / "cassandra.yaml").resolve()
    template = Template((TEMPLATES / "cassandra.yaml").read_text())
    keystore = node_certs(config.node_dir)
    yaml_path.write_text(
        template.substitute(
            host=host, native_port=native_port, storage_port=storage_port, keystore=keystore, truststore=CertSet(keystore.parent).ca_file
        )
    )
    (logs / "system.log").unlink(missing_ok=True)
    argv = _jvm_argv(config, java, lib, yaml_path, logs.resolve())
    with open(logs / "stdout.log", "wb") as stdout:
        process = subprocess.Popen(
            argv,
            cwd=config.node_dir,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent if die_with_parent else None,
        )
    node = RunningNode(pid=process.pid, host=host, native_port=native_port, storage_port=storage_port, node_dir=config.node_dir)
    try:
        ready_lines = (READY_LINE, SUPERUSER_LINE) if is_new else (READY_LINE,)
        _wait_ready(process, logs / "system.log", time.monotonic() + config.start_timeout_s, ready_lines)
    except StartupError as exc:
        _stop_pid(process.pid, timeout_s=10)
        process.wait()
        raise StartupError(f"{exc}; last log lines ({logs}):\n{_log_tail(logs)}") from None
    (config.node_dir / STATE_FILE).write_text(
        json.dumps({"pid": node.pid, "host": host, "native_port": native_port, "storage_port": storage_port})
    )
    return node


def read_state(node_dir: Path) -> RunningNode | None:
    try:
        state = json.loads((node_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return RunningNode(
        pid=state["pid"], host=state["host"], native_port=state["native_port"], storage_port=state["storage_port"], node_dir=node_dir
    )


def stop_node(node: RunningNode, timeout_s: float = 30.0, *, kill: bool = False) -> None:
    """SIGTERM (Cassandra drains), SIGKILL after timeout_s or at once with kill=True."""
    if node.is_alive():
        _stop_pid(node.pid, timeout_s=0 if kill else timeout_s)
    (node.node_dir / STATE_FILE).unlink(missing_ok=True)


def _stop_pid(pid: int, timeout_s: float) -> None:
    try:
        os.kill(pid, signal.SIGKILL if timeout_s <= 0 else signal.SIGTERM)
    except ProcessLookupError:
        return
    killed = timeout_s <= 0
    deadline = time.monotonic() + (KILLED_EXIT_WAIT_S if killed else timeout_s)
    while _pid_alive(pid):
        if time.monotonic() > deadline:
            if killed:  # in uninterruptible sleep (a hung disk), or not ours any more: say so, do not wait for ever
                raise TimeoutError(f"process {pid} is still alive {KILLED_EXIT_WAIT_S:.0f} s after SIGKILL")
            os.kill(pid, signal.SIGKILL)
            killed = True
            deadline = time.monotonic() + KILLED_EXIT_WAIT_S
        _reap(pid)
        time.sleep(0.1)
    _reap(pid)  # a child of ours killed above is a zombie until reaped


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass  # not our child: its own parent reaps it


def _log_tail(logs: Path, num_lines: int = 25) -> str:
    lines: list[str] = []
    for name in ("stdout.log", "system.log"):
        path = logs / name
        if path.is_file():
            lines += [f"{name}: {line}" for line in path.read_text(errors="replace").splitlines()[-num_lines:]]
    return "\n".join(lines[-num_lines:])


# `tandem cassandra up|down|status`: a node for development that outlives the command.


def add_cli(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("cassandra", help="a local Cassandra 5.0 node (JDK 17 and mvn): up, down, status")
    actions = parser.add_subparsers(dest="action", required=True)
    up = actions.add_parser("up", help="start it in the background and wait until CQL answers")
    up.add_argument("--port", type=int, default=9042, help="CQL port (default 9042, TANDEM_CASSANDRA_HOSTS's default)")
    up.add_argument("--heap-mib", type=int, default=512)
    down = actions.add_parser("down", help="stop it (SIGTERM; SIGKILL after 30 s)")
    down.add_argument("--wipe", action="store_true", help="delete its data too")
    actions.add_parser("status", help="exit 0 when it runs and answers")
    for action in (up, down, actions.choices["status"]):
        action.add_argument("--dir", type=Path, default=Path(".tandem/cassandra"), help="the node's folder (default .tandem/cassandra)")
    parser.set_defaults(run=_cli)


def _cli(args: argparse.Namespace) -> int:
    node = read_state(args.dir)
    if args.action == "up":
        started_s = time.monotonic()
        node = start_node(NodeConfig(node_dir=args.dir, native_port=args.port, heap_mib=args.heap_mib), die_with_parent=False)
        print(f"Cassandra {CASSANDRA_VERSION} ready in {time.monotonic() - started_s:.1f} s (pid {node.pid}, logs {args.dir / 'logs'})")
        print(f"TANDEM_STORE=cassandra TANDEM_CASSANDRA_HOSTS={node.hosts} TANDEM_CASSANDRA_CA_FILE={node.ca_file}")
        return 0
    if args.action == "down":
        if node is not None:
            stop_node(node)
            print(f"stopped pid {node.pid}")
        else:
            print(f"no node runs from {args.dir}")
        if args.wipe:
            shutil.rmtree(args.dir, ignore_errors=True)
        return 0
    if node is None or not node.is_alive():
        print(f"not running (from {args.dir})")
        return 1
    is_answering = node.answers()
    print(f"pid {node.pid}, CQL {node.hosts} {'answers' if is_answering else 'does NOT answer'}")
    return 0 if is_answering else 1
