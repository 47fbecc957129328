"""`kafscale dev`: the first README command, with Ctrl-C and --data-dir."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kafscale.devstack import free_port, wait_port
from tests.integration.clients import Rec, confluent_consume, confluent_produce, create_topic


def start_dev(data_dir, port: int, etcd_port: int, s3_port: int, log, admin_port: int | None = None
              ) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "kafscale.cli", "dev", "--data-dir", str(data_dir),
                             "--port", str(port), "--etcd-port", str(etcd_port), "--s3-port", str(s3_port),
                             "--admin-listen", f"127.0.0.1:{admin_port or free_port()}"],
                            stdout=log, stderr=subprocess.STDOUT)
    wait_port(port, proc, "kafscale dev", Path(log.name), timeout=120)
    return proc


def ctrl_c(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGINT)
    return proc.wait(60)


def test_dev_keeps_data_across_restarts(tmp_path):
    ports = (free_port(), free_port(), free_port())
    bootstrap = f"127.0.0.1:{ports[0]}"
    with open(tmp_path / "dev.log", "ab") as log:
        proc = start_dev(tmp_path / "data", *ports, log)
        create_topic(bootstrap, "persisted")
        sent = [Rec(f"k{i}".encode(), f"v{i}".encode()) for i in range(50)]
        assert confluent_produce(bootstrap, "persisted", sent, "snappy") == list(range(50))
        assert ctrl_c(proc) == 0
        for port in ports:  # Ctrl-C stopped all three servers
            with socket.socket() as s:
                assert s.connect_ex(("127.0.0.1", port)) != 0
        proc = start_dev(tmp_path / "data", *ports, log)
        try:
            assert [r for _, r in confluent_consume(bootstrap, "persisted", 50)] == sent
            assert confluent_produce(bootstrap, "persisted", [Rec(b"k", b"after restart")]) == [50]
        finally:
            assert ctrl_c(proc) == 0


def test_broker_fails_fast_when_etcd_or_s3_is_unusable(stack):
    base = [sys.executable, "-m", "kafscale.cli", "broker", "--listen", f"127.0.0.1:{free_port()}"]
    env = {**os.environ, **stack.broker_env()}
    cases = [
        (["--etcd", f"127.0.0.1:{free_port()}"], "etcd at 127.0.0.1"),
        (["--s3-endpoint", f"http://127.0.0.1:{free_port()}"], "is not writable"),
    ]
    for extra, message in cases:
        r = subprocess.run(base + extra, env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, r.stderr[-2000:]
        assert "kafscale: cannot start" in r.stderr and message in r.stderr


def test_the_dev_s3_refuses_anonymous_requests(stack):
    """The dev SeaweedFS knows one identity, the documented keys: a request
    without them (any local user, straight to S3) is refused."""
    import botocore.config
    import botocore.session
    from botocore import UNSIGNED
    from botocore.exceptions import ClientError

    anon = botocore.session.get_session().create_client(
        "s3", endpoint_url=stack.s3_endpoint, region_name="us-east-1",
        config=botocore.config.Config(signature_version=UNSIGNED, retries={"max_attempts": 1}))
    for call in (lambda: anon.list_objects_v2(Bucket=stack.bucket),
                 lambda: anon.put_object(Bucket=stack.bucket, Key="anonymous", Body=b"x"),
                 lambda: anon.get_object(Bucket=stack.bucket, Key="_kafscale/ready")):
        with pytest.raises(ClientError, match="AccessDenied"):
            call()
    stack.s3_client().head_object(Bucket=stack.bucket, Key="_kafscale/ready")  # the keys still work


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")
def test_the_dev_storage_servers_never_take_the_cpu_from_the_broker_on_waking(stack):
    """etcd and SeaweedFS, and every thread they started since, run as
    SCHED_BATCH: a request the broker sends them does not stall it."""
    for proc in stack.procs:
        threads = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task")]
        assert len(threads) > 1, proc.args[0]
        assert {os.sched_getscheduler(t) for t in threads} == {os.SCHED_BATCH}, proc.args[0]


def kafscale_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kafscale.cli", *args], capture_output=True, text=True, timeout=60)


def test_dev_is_ready_for_a_first_try(tmp_path):
    """kafscale dev auto-creates topics, serves the console and says where;
    `kafscale topics create/delete` work and bad input gets one line and a
    non-zero exit, not a traceback."""
    import urllib.request

    ports = (free_port(), free_port(), free_port())
    admin = free_port()
    bootstrap = f"127.0.0.1:{ports[0]}"
    with open(tmp_path / "dev.log", "ab") as log:
        proc = start_dev(tmp_path / "data", *ports, log, admin_port=admin)
    try:
        assert f"console=http://127.0.0.1:{admin}/" in (tmp_path / "dev.log").read_text()
        assert confluent_produce(bootstrap, "never-created", [Rec(b"k", b"v")]) == [0]  # auto-created
        with urllib.request.urlopen(f"http://127.0.0.1:{admin}/api/overview", timeout=10) as r:
            assert "never-created" in {t["name"] for t in json.loads(r.read())["topics"]}
        r = kafscale_cli("topics", "create", "orders", "--partitions", "3", "--config", "retention.ms=60000",
                         "--bootstrap", bootstrap)
        assert r.returncode == 0 and "created orders with 3 partitions" in r.stdout, r.stderr
        r = kafscale_cli("topics", "describe", "orders", "--bootstrap", bootstrap)
        assert "Partitions: 3" in r.stdout and "retention.ms=60000" in r.stdout, r.stderr
        for args, message in ((["create", "orders"], "TOPIC_ALREADY_EXISTS"),
                              (["create", "bad", "--config", "no.such.key=1"], "INVALID_CONFIG"),
                              (["create", "zero", "--partitions", "0"], "must be 1 or more"),
                              (["delete", "missing"], "UNKNOWN_TOPIC_OR_PARTITION")):
            r = kafscale_cli("topics", *args, "--bootstrap", bootstrap)
            assert r.returncode != 0 and message in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
        r = kafscale_cli("topics", "delete", "orders", "--bootstrap", bootstrap)
        assert r.returncode == 0 and "deleted orders" in r.stdout, r.stderr
        r = kafscale_cli("topics", "ls", "--bootstrap", f"127.0.0.1:{free_port()}")
        assert r.returncode != 0 and "Traceback" not in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    finally:
        assert ctrl_c(proc) == 0
