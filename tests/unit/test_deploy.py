"""The container image and Kubernetes manifests, checked offline (no Docker
engine or cluster here): manifests against the Kubernetes API schemas,
every KAFSCALE_* variable against the real configuration fields, probes
against the admin endpoint, and the Dockerfile's build context against an
actual wheel build."""
from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kafscale.config import Config

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))
DOCKERFILE = ROOT / "docker" / "Dockerfile"
CONFIG_VARS = {f"KAFSCALE_{f.name.upper()}" for f in dataclasses.fields(Config)}


def documents() -> list[dict]:
    return [d for m in MANIFESTS for d in yaml.safe_load_all(m.read_text()) if d]


def containers(kind: str, name: str) -> list[dict]:
    for d in documents():
        if d["kind"] == kind and d["metadata"]["name"] == name:
            return d["spec"]["template"]["spec"]["containers"]
    raise AssertionError(f"no {kind} {name}")


@pytest.mark.parametrize("version", ["1.30.0", "1.37.0"])
def test_manifests_match_the_kubernetes_schemas(version):
    kv = pytest.importorskip("kubernetes_validate")
    assert MANIFESTS
    for d in documents():
        kv.validate(d, version, strict=True)  # raises on any schema error


def test_every_kafscale_variable_is_a_config_field():
    used = set(re.findall(r"KAFSCALE_[A-Z0-9_]+", DOCKERFILE.read_text()))
    for m in MANIFESTS:
        used |= set(re.findall(r"KAFSCALE_[A-Z0-9_]+", m.read_text()))
    assert used and used <= CONFIG_VARS, sorted(used - CONFIG_VARS)


def test_broker_and_proxy_probe_the_admin_endpoint():
    for kind, name in (("Deployment", "kafscale-broker"), ("Deployment", "kafscale-proxy")):
        (c,) = containers(kind, name)
        env = {e["name"]: e.get("value") for e in c["env"]}
        port = int(env["KAFSCALE_ADMIN_LISTEN"].rpartition(":")[2])
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["admin"] == port
        assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "admin"}
        assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "admin"}
    (broker,) = containers("Deployment", "kafscale-broker")
    secrets = {e["name"] for e in broker["env"] if "secretKeyRef" in e.get("valueFrom", {})}
    assert secrets == {"KAFSCALE_S3_ACCESS_KEY", "KAFSCALE_S3_SECRET_KEY"}


def test_broker_ids_from_pod_names_are_valid_and_distinct():
    (broker,) = containers("Deployment", "kafscale-broker")
    script = broker["command"][-1].removesuffix(" exec kafscale broker")
    ids = set()
    for pod in ("kafscale-broker-5d8f7-abcde", "kafscale-broker-5d8f7-fghij", "kafscale-broker-6c9a1-abcde"):
        out = subprocess.run(["sh", "-c", f"{script}; echo $KAFSCALE_NODE_ID"], capture_output=True, text=True,
                             env={"POD_NAME": pod, "PATH": "/usr/bin:/bin"}, check=True).stdout
        ids.add(int(out))
    assert len(ids) == 3 and all(1 <= i < 2**31 for i in ids)


def test_dockerfile_is_multi_stage_non_root_and_its_context_builds(tmp_path):
    text = DOCKERFILE.read_text()
    assert len(re.findall(r"^FROM ", text, re.M)) == 2
    user = re.findall(r"^USER (\S+)", text, re.M)
    assert user and user[-1] not in ("root", "0")
    context = tmp_path / "context"
    for line in re.findall(r"^COPY (?!--from)(.+)$", text, re.M):
        *sources, _dest = line.split()
        for src in sources:
            path = ROOT / src
            target = context / src
            target.parent.mkdir(parents=True, exist_ok=True)
            if path.is_dir():
                shutil.copytree(path, target, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.c"))
            else:
                shutil.copy(path, target)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "--wheel-dir", str(tmp_path / "wheels"), str(context)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    (wheel,) = (tmp_path / "wheels").glob("kafscale-*.whl")
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("kafscale/_native/core.") and n.endswith(".so") for n in names), "native extension built"


def test_network_policies_close_etcd_and_the_admin_ports():
    """Default deny; etcd only from the brokers, the proxy and its peers; the
    admin port (console, /metrics) only in-namespace and from monitoring."""
    policies = {d["metadata"]["name"]: d["spec"] for d in documents() if d["kind"] == "NetworkPolicy"}
    assert policies["default-deny-ingress"] == {"podSelector": {}, "policyTypes": ["Ingress"]}
    etcd = policies["etcd-from-kafscale-only"]
    assert etcd["podSelector"] == {"matchLabels": {"app": "etcd"}}
    sources = {s["podSelector"]["matchLabels"]["app"] for rule in etcd["ingress"] for s in rule["from"]}
    assert sources == {"kafscale-broker", "kafscale-proxy", "etcd"}
    admin_rules = [r for r in policies["kafka-clients-and-admin"]["ingress"] if r["ports"] == [{"port": 9644}]]
    assert admin_rules and all(r.get("from") for r in admin_rules), "the admin port is never open to all"
    assert not [d for d in documents() if d["kind"] == "Service"
                and any(p.get("port") == 9644 for p in d["spec"]["ports"])], "no Service exposes the admin port"
