"""Clients in other languages, built or installed once per test session:
Sarama (Go, from Debian's golang-github-shopify-sarama-dev, GOPATH mode, no
module download) and Node clients (kafkajs, @platformatic/kafka) from npm."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

HERE = Path(__file__).parent
NODE = HERE / "node"
GOPATH = "/usr/share/gocode"  # where Debian's Go library packages install their source


def build_go(program: str | Path, out_dir: Path) -> Path:
    """Compile tests/integration/go/{program} (or the program in directory
    `program`) against Debian's Sarama; returns the binary."""
    go = shutil.which("go")
    assert go, "golang-go is not installed (.ci/run installs it)"
    src = program if isinstance(program, Path) else HERE / "go" / program
    out = out_dir / src.name
    env = {**os.environ, "GOPATH": GOPATH, "GO111MODULE": "off", "GOFLAGS": "", "GOCACHE": str(out_dir / "cache"),
           "CGO_CFLAGS": "-Wno-deprecated-declarations"}
    r = subprocess.run([go, "build", "-o", str(out), "."], cwd=src, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def run(binary: Path | str, *args: str, timeout: float = 120) -> str:
    r = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    return r.stdout


def node(script: str, *args: str, timeout: float = 120) -> str:
    """Run tests/integration/node/{script} with the machine's Node (clients from npm, installed by .ci/run)."""
    assert (NODE / "node_modules").is_dir(), "run `npm ci --prefix tests/integration/node` (.ci/run does)"
    return run(shutil.which("node") or "node", str(NODE / script), *args, timeout=timeout)
