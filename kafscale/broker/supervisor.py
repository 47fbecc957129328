"""`kafscale broker`: the supervisor of one or more broker nodes.

Per node it maps the shared memory, forks the log process, waits until it is
ready (etcd and S3 reachable, broker registered), then forks the protocol
workers, which share the Kafka port through SO_REUSEPORT and listen on it
once every one of them is ready. A worker that dies
is replaced; a log process that dies takes the whole node down (non-zero
exit) so that another broker takes its partitions over, and nothing it
acknowledged is lost because acks follow the etcd commit. SIGTERM/SIGINT
drain: workers stop accepting, the log process flushes and hands over."""
from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from kafscale import metrics
from kafscale.broker.shm import SharedArea
from kafscale.config import Config
from kafscale.lifecycle import started, stop_on_signals

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # glibc mallopt parameters
MALLOC_ARENAS = 2
STARTUP_FAILED = 2
LOG_SWITCH_INTERVAL_S = 0.0005  # see start_log


GC_THRESHOLDS = (200_000, 1, 80)  # young objects before a collection; every 2nd also collects the middle
# generation, every 80th of those everything


def _tune_malloc() -> None:
    """Keep segment-sized buffers (built segments, produce requests, GET
    windows: up to 32 MiB) on the heap and let the heap keep up to 128 MiB
    free, so freed buffers are reused rather than handed back to the kernel
    and faulted in page by page (zeroed) the next time. With glibc's dynamic
    defaults the log process took about one fault for every 8 KiB produced.
    At most MALLOC_ARENAS heaps, so that what each may keep free is not
    multiplied by the S3 body threads (glibc gives threads up to 8 per core):
    a worker replaying a 256 MiB backlog peaked 59-87 MiB above its start
    with one arena per thread, 42-75 MiB with 2, and read as fast.
    Forked children inherit the setting. Not glibc (musl): nothing to do.
    protobuf (7.36.2) undoes this in part: its upb module calls
    malloc_trim(0) after every 10,000 message arenas it frees, which hands
    every free page of every heap back. The etcd client's transactions
    therefore skip protobuf's message classes (metadata.etcd_client's
    encode_txn): the log process's trims went from one every 5-10 s to
    about one every two minutes (bench/history.md, session 81)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt(_M_MMAP_THRESHOLD, 32 << 20)
    mallopt(_M_TRIM_THRESHOLD, 128 << 20)
    mallopt(_M_ARENA_MAX, MALLOC_ARENAS)


def _tune_gc() -> None:
    """Collect cyclic garbage less often than Python's defaults (700, 10, 10),
    which suit short scripts: a broker allocates a few hundred container
    objects per request and keeps many alive (partition state, manifests), so
    the collector ran hundreds of times a second and was 32% of the log
    process's time at 1,000 partitions (py-spy; 6% after). What is alive
    after the imports is frozen (never scanned, and not copied by the forked
    children's scans). A young collection goes through the young objects
    still alive, nearly all of them a request's under way (its payloads'
    views and handles, queued batches, answers, slices, manifests): with
    a collection every 50,000 of them, one came about as often as a request
    took, so nearly every object a request made was gone through. Every
    200,000, a collection comes about a quarter as often and fewer of a
    request's objects are alive when it does: at 10,000 partitions and 20,000
    records/s the collections over 5 ms during a 30 s load fell from 2.3-2.7
    s to 0.3-0.4, and at 1,000 partitions Sarama's ack p99 from a median of
    559 ms to 362 over six alternating pairs (librdkafka at 100 partitions:
    within the runs' spread; bench/README.md, session 100). The middle
    generation is collected every 2nd young collection, so that what it goes
    through does not grow with the young threshold (at 20 young collections
    to 50,000, each of its collections held the log process for up to 580 ms
    at 10,000 partitions: everything that lived through 20 of them); the full
    collection comes every 80 of those. Forked children inherit both."""
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def _in_child(role: str) -> None:
    """Reset what the supervisor set up; die with the supervisor."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    for h in logging.getLogger().handlers:
        h.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s [{role}] %(name)s: %(message)s"))


def _fork(role: str, main: Callable[[int], None]) -> tuple[int, int]:
    """Fork a child running main(ready_fd); returns (pid, read end of its ready pipe)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(r)
            _in_child(role)
            main(w)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException as exc:
            from kafscale.broker.node import StartupError

            if isinstance(exc, StartupError | OSError):
                print(f"kafscale: cannot start: {exc}", file=sys.stderr)
                code = STARTUP_FAILED
            else:
                logging.getLogger(role).exception("%s failed", role)
                code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.close(w)
    return pid, r


def _wait_ready(pid: int, ready: int) -> int | None:
    """None once the child wrote its ready byte; else its exit status."""
    got = os.read(ready, 1)
    os.close(ready)
    if got:
        return None
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


async def _watching_loop_lag(main: Coroutine[Any, Any, None]) -> None:
    """Run a process's main coroutine, observing its event loop's lag meanwhile."""
    watch = asyncio.create_task(metrics.watch_loop_lag())
    try:
        await main
    finally:
        watch.cancel()


async def _worker_main(cfg: Config, area: SharedArea, slot: int, socket_path: str, ready_fd: int,
                       go_fd: int) -> None:
    """A worker: ready once connected to the log process with the Kafka port
    bound, listening once the supervisor says go (a byte on go_fd), until
    stopped or its log process is gone."""
    from kafscale.broker.worker import Worker

    w = Worker(cfg, area, slot)
    try:
        await w.start(socket_path)
    except BaseException:
        await w.stop()
        raise
    stop = stop_on_signals()
    started(ready_fd)
    stopping = asyncio.create_task(stop.wait())
    go = asyncio.create_task(_byte_from(go_fd))
    await asyncio.wait([go, stopping], return_when=asyncio.FIRST_COMPLETED)
    if go.done() and go.result() and not stopping.done():  # not stopped (nor the supervisor gone) first
        await w.listen()
        log_gone = asyncio.create_task(w.run_until_log_process_exits())
        await asyncio.wait([log_gone, stopping], return_when=asyncio.FIRST_COMPLETED)
        if stopping.done():  # stop taking connections; answer what is in flight while the log process drains
            w.stop_listening()
            await asyncio.wait([log_gone], timeout=60)
    go.cancel()
    stopping.cancel()
    await w.stop()


async def _byte_from(fd: int) -> bool:
    """Wait until fd (a pipe's read end) is readable: whether a byte came (False: closed)."""
    loop = asyncio.get_running_loop()
    readable = loop.create_future()
    loop.add_reader(fd, lambda: readable.done() or readable.set_result(None))
    try:
        await readable
    finally:
        loop.remove_reader(fd)
    got = os.read(fd, 1)
    os.close(fd)
    return got != b""


@dataclass
class NodeProcesses:
    cfg: Config
    workers: int
    area: SharedArea
    dir: str
    log_pid: int = 0
    worker_pids: dict[int, int] = field(default_factory=dict)  # pid -> slot

    @property
    def socket_path(self) -> str:
        return os.path.join(self.dir, "log.sock")

    @property
    def metrics_dir(self) -> str:
        """Where every process of the node writes its Prometheus samples."""
        return os.path.join(self.dir, "metrics")

    def start_log(self) -> int | None:
        from kafscale.broker.node import run_log_process

        def main(fd: int) -> None:
            metrics.init_process(self.cfg.node_id, "log", self.metrics_dir)
            # The log process's S3 threads wait for the GIL after every socket read while its event
            # loop is busy: at the default 5 ms switch interval a PUT took several times its time.
            sys.setswitchinterval(LOG_SWITCH_INTERVAL_S)
            self.area.populate()
            asyncio.run(_watching_loop_lag(run_log_process(self.cfg, self.area, self.socket_path, fd)))

        self.log_pid, ready = _fork(f"log {self.cfg.node_id}", main)
        return _wait_ready(self.log_pid, ready)

    def _fork_worker(self, slot: int, others: tuple[int, ...] = ()) -> tuple[int, int, int]:
        """Fork a slot's worker: its pid, the read end of its ready pipe and
        the write end of its go pipe (it listens once that gets a byte; it
        stops if the pipe closes first). `others`: the pipe ends this process
        holds for the workers forked before, which the new one closes."""
        go_r, go_w = os.pipe()

        def main(fd: int) -> None:
            for other in (go_w, *others):
                os.close(other)
            metrics.init_process(self.cfg.node_id, str(slot), self.metrics_dir)
            self.area.populate()
            asyncio.run(_watching_loop_lag(_worker_main(self.cfg, self.area, slot, self.socket_path, fd, go_r)))

        pid, ready = _fork(f"worker {self.cfg.node_id}.{slot}", main)
        os.close(go_r)
        self.worker_pids[pid] = slot
        return pid, ready, go_w

    def start_workers(self) -> int | None:
        """Start every worker at once, and let them listen once all are ready
        (None), or say how the first that failed exited. Until then the port
        refuses connections: one made while only some workers listened would
        stay on those for its lifetime, and the others' start (faulting the
        shared memory in) would take CPU from the first clients' requests."""
        forked: list[tuple[int, int, int]] = []
        for slot in range(self.workers):
            forked.append(self._fork_worker(slot, tuple(fd for _, *fds in forked for fd in fds)))
        rc = None
        for pid, ready, _ in forked:
            if rc is None:
                rc = _wait_ready(pid, ready)
                if rc is not None:
                    del self.worker_pids[pid]
            else:
                os.close(ready)
        for _, _, go in forked:
            if rc is None:
                os.write(go, b"1")
            os.close(go)  # without a byte the worker stops
        return rc

    def restart_worker(self, slot: int) -> None:
        """Replace a slot's worker that exited: it listens as soon as it is ready."""
        _, ready, go = self._fork_worker(slot)
        os.write(go, b"1")
        os.close(go)
        os.close(ready)

    def pids(self) -> list[int]:
        return [p for p in (self.log_pid, *self.worker_pids) if p]

    def signal(self, sig: int) -> None:
        for pid in self.pids():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


def _listen_port_free(cfg: Config) -> None:
    """Refuse a port someone else listens on (SO_REUSEPORT would share it)."""
    host, port = cfg.listen_addr()
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is fine, a listener is not
        s.bind((host, port))


def run_nodes(cfgs: list[Config]) -> int:
    """Run the nodes until SIGINT/SIGTERM; the process exit code."""
    nodes: list[NodeProcesses] = []
    _tune_malloc()
    _tune_gc()
    try:
        for cfg in cfgs:
            _listen_port_free(cfg)
            n = cfg.workers or os.cpu_count() or 1
            nodes.append(NodeProcesses(cfg, n, SharedArea(n, cfg.ring_bytes, cfg.cache_bytes),
                               tempfile.mkdtemp(prefix="kafscale-")))
            os.mkdir(nodes[-1].metrics_dir)
    except OSError as exc:
        print(f"kafscale: cannot start: {exc}", file=sys.stderr)
        return STARTUP_FAILED
    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for node in nodes:
            node.signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        for node in nodes:
            rc = node.start_log()
            if rc is None:
                rc = node.start_workers()
            if rc is not None:  # a child failed to start, or we were told to stop while starting
                asked_to_stop, stopping = stopping, True
                for other in nodes:
                    other.signal(signal.SIGTERM)
                _reap_all(nodes)
                return 0 if asked_to_stop else (rc if rc > 0 else 1)
        for node in nodes:
            host, port = node.cfg.listen_addr()
            log.info("broker %d: Kafka listener on %s:%d (%d workers)", node.cfg.node_id, host, port, node.workers)
        return _supervise(nodes, lambda: stopping)
    finally:
        for node in nodes:
            shutil.rmtree(node.dir, ignore_errors=True)


def _supervise(nodes: list[NodeProcesses], stopping: Callable[[], bool]) -> int:
    code = 0
    while any(node.pids() for node in nodes):
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        rc = os.waitstatus_to_exitcode(status)
        for node in nodes:
            if pid == node.log_pid:
                node.log_pid = 0
                if not stopping():
                    log.error("broker %d: log process exited (%d); stopping the node", node.cfg.node_id, rc)
                    node.signal(signal.SIGKILL)
                    code = 1
            elif pid in node.worker_pids:
                slot = node.worker_pids.pop(pid)
                if node.log_pid and os.waitpid(node.log_pid, os.WNOHANG)[0]:  # its log process is gone too
                    node.log_pid = 0
                    if not stopping():
                        log.error("broker %d: log process exited; stopping the node", node.cfg.node_id)
                        node.signal(signal.SIGKILL)
                        code = 1
                if not stopping() and node.log_pid:
                    log.warning("broker %d: worker %d exited (%d); starting a new one", node.cfg.node_id, slot, rc)
                    node.restart_worker(slot)
    return code


def _reap_all(nodes: list[NodeProcesses]) -> None:
    for node in nodes:
        for pid in node.pids():
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        node.log_pid = 0
        node.worker_pids.clear()
