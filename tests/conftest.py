"""Shared fixtures: a real etcd and a real SeaweedFS S3 for the whole session,
and KafScale brokers run as real `kafscale broker` processes on free ports."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

# Before kafscale is imported, here and in every broker the tests start: the
# codec refuses unknown keys and dropped error codes instead of losing them.
os.environ["KAFSCALE_STRICT_CODEC"] = "1"

from kafscale.devstack import DevStack, free_port


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevStack]:
    s = DevStack(data_dir=str(tmp_path_factory.mktemp("stack"))).start()
    yield s
    s.stop()


_READY = "workers)"  # the supervisor's "Kafka listener on HOST:PORT (N workers)"


class BrokerProcess:
    """One `kafscale broker` process; restartable on the same port and cluster."""

    def __init__(self, stack: DevStack, logdir: Path, cluster: str, command: str = "broker",
                 **config: object) -> None:
        self.command = command
        self.stack = stack
        self.port = free_port()
        self.cluster = cluster
        # every broker serves /readyz: it is up once that says so (see _ready)
        self.config = {"admin_listen": f"127.0.0.1:{free_port()}", **config} if command == "broker" else config
        self.logfile = logdir / f"{command}-{cluster}-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def broker_id(self) -> int:
        return int(self.config.get("node_id", 1))

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.stack.broker_env())
        env["KAFSCALE_CLUSTER"] = self.cluster
        env["KAFSCALE_NAMESPACE"] = self.cluster
        env["KAFSCALE_LISTEN"] = self.bootstrap
        for k, v in self.config.items():
            env[f"KAFSCALE_{k.upper()}"] = str(v)
        return env

    def _ready(self, ready_lines: int) -> bool:
        """A broker is up once its supervisor reports every worker listening and
        its /readyz answers (etcd, S3, registration and the Kafka listener ok;
        a broker restarted while marked draining is up without that check); a
        proxy when it accepts."""
        if self.command != "broker":
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", self.port)) == 0
        if self.log().count(_READY) <= ready_lines:
            return False
        try:
            with urllib.request.urlopen(f"http://{self.config['admin_listen']}/readyz", timeout=5) as r:
                return r.status == 200
        except urllib.error.HTTPError as exc:
            failing = {k for k, v in json.loads(exc.read()).get("checks", {}).items() if v != "ok"}
            return failing == {"draining"}
        except OSError:
            return False

    def launch(self) -> None:
        """Start the process, without waiting for it to be up (start waits)."""
        with open(self.logfile, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "kafscale.cli", self.command], env=self.env(),
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def start(self) -> BrokerProcess:
        ready_lines = self.log().count(_READY)
        self.launch()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"broker exited {self.proc.returncode}: {self.log()[-2000:]}")
            if self._ready(ready_lines):
                return self
            time.sleep(0.05)
        raise RuntimeError(f"broker did not listen: {self.log()[-2000:]}")

    def kill(self) -> None:
        """SIGKILL the whole node: supervisor, log process and workers."""
        self.signal(signal.SIGKILL)
        assert self.proc is not None
        self.proc.wait()

    def signal(self, sig: int) -> None:
        """Signal every process of the node (its own process group)."""
        assert self.proc is not None
        os.killpg(self.proc.pid, sig)

    @staticmethod
    def signal_pid(pid: int, sig: int) -> None:
        os.kill(pid, sig)

    def children(self) -> list[int]:
        """Pids of the supervisor's children (the log process first, then the workers)."""
        assert self.proc is not None
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(self.proc.pid), "--sort", "start_time"],
                             capture_output=True, text=True).stdout
        return [int(x) for x in out.split()]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        return self.logfile.read_text(errors="replace") if self.logfile.exists() else ""


@pytest.fixture
def make_broker(stack: DevStack, tmp_path: Path) -> Iterator:
    """Factory for brokers in a fresh cluster namespace (isolated etcd prefix and S3 prefix)."""
    made: list[BrokerProcess] = []

    def make(**config: object) -> BrokerProcess:
        b = BrokerProcess(stack, tmp_path, f"t{uuid.uuid4().hex[:10]}", **config)
        made.append(b)
        return b.start()

    yield make
    for b in made:
        b.stop()


@pytest.fixture
def make_cluster(stack: DevStack, tmp_path: Path) -> Iterator:
    """Factory for n brokers (node ids 1..n) sharing one cluster namespace."""
    made: list[BrokerProcess] = []

    def make(n: int, proxy: bool = False, **config: object) -> list[BrokerProcess]:
        """n brokers (node ids 1..n), then the cluster's proxy if asked for."""
        cluster = f"c{uuid.uuid4().hex[:10]}"
        procs = [BrokerProcess(stack, tmp_path, cluster, node_id=i + 1, **config) for i in range(n)]
        if proxy:  # the same settings (SASL, proxy_secret, ...) as its brokers
            procs.append(BrokerProcess(stack, tmp_path, cluster, command="proxy", **config))
        made.extend(procs)
        return [b.start() for b in procs]

    yield make
    for b in made:
        b.stop()


@pytest.fixture(scope="module")
def broker(stack: DevStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    """A broker shared by a test module (auto-create on, so clients may produce at once)."""
    b = BrokerProcess(stack, tmp_path_factory.mktemp("broker"), f"m{uuid.uuid4().hex[:10]}",
                      auto_create_topics="true", default_partitions=1).start()
    yield b
    b.stop()


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a server certificate for 127.0.0.1 and a client certificate."""
    d = tmp_path_factory.mktemp("certs")
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
            "-subj", "/CN=kafscale-test-ca", cwd=d)
    exts = {"server": "subjectAltName=IP:127.0.0.1,DNS:localhost", "client": "extendedKeyUsage=clientAuth"}
    for name, ext in exts.items():
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                "-subj", f"/CN={name}", cwd=d)
        (d / f"{name}.ext").write_text(ext + "\n")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)
    return d


@pytest.fixture
def topic_name() -> str:
    return f"topic-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="session")
def spark() -> Iterator:
    """One local Spark session (2 cores) with the kafscale data source registered."""
    pytest.importorskip("pyspark")
    from pyspark.sql import SparkSession

    from kafscale.spark import register

    session = (SparkSession.builder.master("local[2]").appName("kafscale-tests")
               .config("spark.sql.session.timeZone", "UTC").config("spark.ui.enabled", "false")
               .config("spark.sql.shuffle.partitions", "4").getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    register(session)
    yield session
    session.stop()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything under tests/integration needs real etcd, SeaweedFS and brokers:
    `pytest -m "not integration"` runs the unit tests alone."""
    for item in items:
        if "integration" in item.path.parts:
            item.add_marker(pytest.mark.integration)
