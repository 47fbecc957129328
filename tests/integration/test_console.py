"""The web console in headless Chromium (Debian's chromium): the page the
browser renders, after its scripts ran, shows the cluster; its screenshot is
a real, non-blank picture; writes need the operator's basic-auth password."""
from __future__ import annotations

import base64
import json
import shutil
import signal
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zlib
from pathlib import Path

import pytest
from confluent_kafka import Consumer, TopicPartition

from kafscale.devstack import free_port
from tests.conftest import BrokerProcess
from tests.integration.clients import Rec, confluent_produce, create_topic
from tests.integration.test_groups import Member, wait_for

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")


def chromium(*args: str, profile: Path) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                           "--disable-background-networking", "--disable-component-update", "--disable-sync",
                           f"--user-data-dir={profile}", "--virtual-time-budget=8000", *args],
                          capture_output=True, timeout=120, check=True)


def png_pixels(path: Path) -> tuple[int, int, list[bytes]]:
    """Width, height and the unfiltered rows of an 8-bit RGB(A) PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "a PNG file"
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            width, height, depth, color = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and color in (2, 6)
            bpp = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    raw, rows, prev = zlib.decompress(idat), [], bytes(width * bpp)
    stride = width * bpp + 1
    for y in range(height):
        f, line = raw[y * stride], bytearray(raw[y * stride + 1:(y + 1) * stride])
        for i in range(len(line)):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = bytes(line)
    return width, height, rows


@pytest.fixture
def console_broker(make_broker, topic_name):
    admin = f"127.0.0.1:{free_port()}"
    b = make_broker(workers=1, admin_listen=admin)
    create_topic(b.bootstrap, topic_name, partitions=2)
    # one request, so one segment whatever the broker's linger does with a client's burst
    confluent_produce(b.bootstrap, topic_name, [Rec(b"k", b"v")] * 30, partition=1, **{"linger.ms": 1000})
    c = Consumer({"bootstrap.servers": b.bootstrap, "group.id": f"console-{topic_name}"})
    c.commit(offsets=[TopicPartition(topic_name, 1, 12)], asynchronous=False)
    c.close()
    return b, admin


def test_console_renders_the_cluster_in_chromium(console_broker, topic_name, tmp_path):
    _b, admin = console_broker
    dom = chromium("--dump-dom", f"http://{admin}/", profile=tmp_path / "p1").stdout.decode()
    assert topic_name in dom, "the topics table was filled by the page's script"
    assert f"console-{topic_name}" in dom and ">18<" in dom, "the group and its lag (30 - 12)"
    assert "etcd ok" in dom and "s3 ok" in dom
    assert "127.0.0.1" in dom, "the broker list"
    shot = tmp_path / "console.png"
    chromium(f"--screenshot={shot}", "--window-size=1280,900", f"http://{admin}/", profile=tmp_path / "p2")
    width, height, rows = png_pixels(shot)
    assert (width, height) == (1280, 900)
    bpp = len(rows[0]) // width
    px = lambda x, y: tuple(rows[y][x * bpp:x * bpp + 3])  # noqa: E731
    assert px(1000, 5) == (0x1D, 0x27, 0x33), "the dark header band is drawn"
    assert px(3, 890) == (0xF4, 0xF6, 0xF8), "the page background is drawn"
    colors = {px(x, y) for y in range(0, height, 15) for x in range(0, width, 7)}
    assert len(colors) > 20, "text, tables and the chart make a varied picture, not a blank page"
    assert post_topic(admin, f"{topic_name}-new", None) == 403, "no console credentials: read-only"
    assert 'id="create" hidden' in dom, "and the page offers no create form"


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def test_console_record_browser_and_group_page_in_chromium(console_broker, topic_name, tmp_path):
    """The topic page reads records over Kafka (text, JSON, headers, paging by
    offset and time); the group page shows the live members of a group that a
    librdkafka consumer and `kafscale consume` share, with their assignment
    and lag."""
    b, admin = console_broker
    ts = int(time.time() * 1000)
    confluent_produce(b.bootstrap, topic_name, [Rec(b"user-1", b'{"id": 1, "name": "ada"}', (("trace", b"t-1"),)),
                                                Rec(None, b"\x00\xffbinary")], timestamps=[ts, ts + 60_000])
    page = get_json(f"http://{admin}/api/topics/{topic_name}/records?partition=0&offset=0")
    assert [r["offset"] for r in page["records"]] == [0, 1] and page["high_watermark"] == 2
    assert base64.b64decode(page["records"][0]["value"]) == b'{"id": 1, "name": "ada"}'
    assert page["records"][0]["headers"] == [["trace", base64.b64encode(b"t-1").decode()]]
    later = get_json(f"http://{admin}/api/topics/{topic_name}/records?partition=0&time={ts + 1}")
    assert [r["offset"] for r in later["records"]] == [1], "from a time: the first record at or after it"
    paged = get_json(f"http://{admin}/api/topics/{topic_name}/records?partition=1&offset=10&limit=5")
    assert [r["offset"] for r in paged["records"]] == [10, 11, 12, 13, 14] and paged["next_offset"] == 15
    group = f"console-{topic_name}"
    member = Member("confluent", b.bootstrap, group, topic_name, tmp_path / "m.txt")
    cli = subprocess.Popen([sys.executable, "-m", "kafscale.cli", "consume", topic_name, "--group", group,
                            "--bootstrap", b.bootstrap], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        def settled() -> bool:
            g = get_json(f"http://{admin}/api/groups/{group}")
            return g["state"] == "Stable" and len(g["members"]) == 2 and all(m["assignment"] for m in g["members"])

        wait_for(settled, 60, "both members to be assigned a partition")
        dom = chromium("--dump-dom", f"http://{admin}/#group/{group}", profile=tmp_path / "p1").stdout.decode()
        assert "state Stable" in dom and "2 members" in dom
        assert "kafscale-consume" in dom and "rdkafka" in dom, "both clients' ids"
        assert f"{topic_name}: 0" in dom and f"{topic_name}: 1" in dom, "each member's assignment"
    finally:
        cli.send_signal(signal.SIGINT)
        assert cli.wait(30) == 0, cli.stderr.read() if cli.stderr else ""
        member.stop()
    dom = chromium("--dump-dom", f"http://{admin}/#topic/{topic_name}", profile=tmp_path / "p2").stdout.decode()
    assert "user-1" in dom and '{"id": 1, "name": "ada"}' in dom and "trace=t-1" in dom, "the newest records, as text"
    assert "offsets 0 to 1" in dom
    shot = tmp_path / "records.png"
    chromium(f"--screenshot={shot}", "--window-size=1280,700", f"http://{admin}/#topic/{topic_name}",
             profile=tmp_path / "p3")
    width, height, rows = png_pixels(shot)
    bpp = len(rows[0]) // width
    colors = {tuple(rows[y][x * bpp:x * bpp + 3]) for y in range(0, height, 9) for x in range(0, width, 5)}
    assert (width, height) == (1280, 700) and len(colors) > 20, "a drawn page with text, not a blank one"


def post_topic(admin: str, name: str, auth: str | None) -> int:
    body = json.dumps({"name": name, "partitions": 3}).encode()
    req = urllib.request.Request(f"http://{admin}/api/topics", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    if auth:
        req.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_console_is_read_only_unless_signed_in(stack, tmp_path, topic_name):
    admin = f"127.0.0.1:{free_port()}"
    b = BrokerProcess(stack, tmp_path, f"cc{topic_name[-8:]}", admin_listen=admin, workers=1,
                      console_user="ops", console_password="s3cret")
    b.start()
    try:
        assert post_topic(admin, topic_name, None) == 401
        assert post_topic(admin, topic_name, "ops:wrong") == 401
        assert post_topic(admin, topic_name, "ops:s3cret") == 201
        assert post_topic(admin, topic_name, "ops:s3cret") == 409
        with urllib.request.urlopen(f"http://{admin}/api/overview", timeout=10) as r:
            o = json.loads(r.read())
        assert o["writable"] is True
        assert [len(t["partitions"]) for t in o["topics"] if t["name"] == topic_name] == [3]
    finally:
        b.stop()


def test_standalone_console_needs_only_etcd_and_s3(console_broker, topic_name, tmp_path):
    b, _ = console_broker
    admin = f"127.0.0.1:{free_port()}"
    log = open(tmp_path / "console.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "kafscale.cli", "console", "--admin-listen", admin],
                            env=b.env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://{admin}/api/overview", timeout=5) as r:
                    o = json.loads(r.read())
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, (tmp_path / "console.log").read_text()
                time.sleep(0.2)
        assert o["health"] == {"etcd": "ok", "s3": "ok"}
        (topic,) = [t for t in o["topics"] if t["name"] == topic_name]
        assert topic["records"] == 30 and topic["segments"] == 1
        assert [g["lag"] for g in o["groups"] if g["group"] == f"console-{topic_name}"] == [18]
    finally:
        proc.terminate()
        proc.wait(30)
