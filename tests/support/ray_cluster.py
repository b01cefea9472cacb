"""A real Ray cluster on this machine for tests/e2e/test_ray.py: raylets on loopback addresses, each its own "node".

Ray is a test dependency only. Its CPU wheel (and msgpack, the one requirement the vLLM test environments lack) is
installed once with ``uv pip install --no-deps --target`` into ``~/.cache/vllm-minicpm-hotfix/ray/`` -- never into
the shared test environment -- and linked into throwaway overlay venvs (tests/support/venvs.py ``overlay_env``) next to
the shared environment's packages.

* ``ray start --head --node-ip-address 127.0.0.2`` and ``ray start --address 127.0.0.2:PORT --node-ip-address
  127.0.0.3`` (and .4, .5, ...): raylets on this machine, each standing in for a node. Ray replaces
  ``127.0.0.1``/``localhost`` with the machine's routable address (``ray._private.services.resolve_ip_for_localhost``),
  other 127/8 addresses it keeps, so every address the cluster announces and connects to is a loopback one. Each
  raylet gets its own ``--temp-dir`` (its session, sockets and logs; under ``/tmp/vmh-ray-*``: unix socket paths must
  stay under 108 bytes), one CPU, a small object store, a custom resource naming it (``node_a``, ``pip_a``, ...) that
  pins work to it, and its own Python and environment (the node's "installation"). No dashboard, free ports for the
  fixed-port services, usage stats off, no prestarted workers.
* Each ``ray start`` runs in a new session (process group); the daemons it leaves behind (GCS, raylet, agents, the
  workers the raylet starts) stay in that group. :meth:`Cluster.stop` ends the groups -- SIGTERM, then SIGKILL after a
  grace period. ``ray stop`` is never used: it stops every Ray process on the machine, whoever started it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

RAY_VERSION = "2.60.0"
MSGPACK_VERSION = "1.2.4"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vllm-minicpm-hotfix" / "ray"
STAMP = ".complete"
#: The i-th raylet announces 127.0.0.(2+i); the head is the first.
HEAD_IP = "127.0.0.2"
OBJECT_STORE_BYTES = 80 * 1024 * 1024
#: Ray settings for every raylet: no usage stats; no idle Python workers started ahead of need (by default each
#: raylet prestarts workers when a driver connects: a wasted interpreter per node and job on 2 cores); the workers of
#: concurrent jobs started at once (the default is one at a time per CPU of the raylet); and workers at the normal
#: priority (Ray runs them at nice 15). With the kernel's autogroup scheduling (``sched_autogroup_enabled``), CPU is
#: shared between sessions, and every raylet is its own session: two busy actors on one raylet get half the CPU of
#: one alone, so the tests give each heavy actor a raylet of its own.
RAY_CONFIG = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_enable_worker_prestart": "0",
              "RAY_prestart_worker_first_driver": "0", "RAY_num_prestart_python_workers": "0",
              "RAY_worker_maximum_startup_concurrency": "4", "RAY_worker_niceness": "0"}
START_TIMEOUT_S = 240
STOP_GRACE_S = 5


def ray_packages(python: str | os.PathLike = sys.executable) -> Path:
    """The folder holding ray and msgpack for ``python``'s version, installed there on first use (from the package
    index, ``uv pip install --no-deps --target``; a few seconds with a warm uv cache, 200 MB)."""
    tag = f"py{sys.version_info.major}{sys.version_info.minor}"
    dest = CACHE / f"ray-{RAY_VERSION}-{tag}"
    if (dest / STAMP).is_file():
        return dest
    from support.venvs import uv

    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    cmd = [uv(), "pip", "install", "--no-deps", "--target", str(tmp), "--python", str(python),
           f"ray=={RAY_VERSION}", f"msgpack=={MSGPACK_VERSION}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"installing ray {RAY_VERSION} failed ({' '.join(cmd)}):\n{proc.stdout}\n{proc.stderr}")
    (tmp / STAMP).write_text(f"ray {RAY_VERSION}, msgpack {MSGPACK_VERSION}\n")
    try:
        tmp.rename(dest)
    except OSError:  # another process finished first
        if not (dest / STAMP).is_file():
            raise
    return dest


def link_ray(python: str | os.PathLike) -> None:
    """Link ray and msgpack into the overlay venv of ``python`` (its site-packages; nothing is copied)."""
    from support.venvs import site_packages

    site = site_packages(python)
    for entry in ray_packages().iterdir():
        if entry.name in ("bin", STAMP):
            continue
        link = site / entry.name
        if not link.exists():
            link.symlink_to(entry)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Node:
    """One raylet: its name (also its custom resource), Python and extra environment; its loopback address is set
    by the cluster."""

    name: str
    python: Path
    env: dict[str, str] = field(default_factory=dict)
    ip: str = ""


@dataclass
class Cluster:
    """Two (or more) raylets started by :meth:`start`, ended by :meth:`stop` (also as a context manager)."""

    work: Path
    nodes: list[Node]
    base_env: dict[str, str]
    port: int = 0
    address: str = ""
    #: The ``ray start`` processes; each leads the process group its daemons stay in.
    procs: list[subprocess.Popen] = field(default_factory=list)
    logs: dict[str, Path] = field(default_factory=dict)
    started_s: float = 0.0
    #: Short folder for the raylets' ``--temp-dir`` (their unix socket paths must stay under 108 bytes).
    temp: Path | None = None

    def _ray(self, node: Node, args: list[str], attempt: int) -> subprocess.Popen:
        log = self.work / f"ray-start-{node.name}-{attempt}.log"
        self.logs[node.name] = log
        env = {**self.base_env, **node.env, **RAY_CONFIG}
        cmd = [str(node.python), "-m", "ray.scripts.scripts", "start", "--node-ip-address", node.ip,
               "--num-cpus", "1", "--resources", json.dumps({node.name: 1}),
               "--object-store-memory", str(OBJECT_STORE_BYTES),
               "--temp-dir", str(self.temp / f"{node.name}-{attempt}"), "--disable-usage-stats", *args]
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, env=env, cwd=self.work, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs.append(proc)
        return proc

    def _start_nodes(self, nodes: list[Node], args: list[str], deadline: float) -> None:
        """``ray start`` for ``nodes`` at once; a node that fails is started once more on its own (its group ended
        first). Ray gives a raylet a fixed 30 s to register with the GCS (``ray._private.node``), which a loaded
        2-core machine can miss."""
        failed = []
        for node, proc in [(n, self._ray(n, args, 1)) for n in nodes]:
            if self._wait(proc, deadline) != 0:
                failed.append((node, proc))
        for node, proc in failed:
            _end_groups([proc])
            rc = self._wait(self._ray(node, args, 2), deadline)
            if rc != 0:
                raise RuntimeError(f"ray start for {node.name} failed twice ({rc}):\n"
                                   f"{self.logs[node.name].read_text()[-4000:]}")

    @staticmethod
    def _wait(proc: subprocess.Popen, deadline: float) -> int | str:
        try:
            return proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return "timeout"

    def start(self) -> Cluster:
        """The head first, then the other raylets two at a time (each ``ray start`` returns once its raylet has
        registered with the GCS)."""
        started = time.monotonic()
        deadline = started + START_TIMEOUT_S
        self.work.mkdir(parents=True, exist_ok=True)
        self.temp = Path(tempfile.mkdtemp(prefix="vmh-ray-", dir="/tmp"))
        for i, node in enumerate(self.nodes):
            node.ip = f"127.0.0.{2 + i}"
        self.port = free_port()
        head, *others = self.nodes
        self._start_nodes([head], ["--head", "--port", str(self.port), "--include-dashboard", "false",
                                   "--dashboard-port", str(free_port()),
                                   "--ray-client-server-port", str(free_port())], deadline)
        self.address = f"{HEAD_IP}:{self.port}"
        for i in range(0, len(others), 2):
            self._start_nodes(others[i:i + 2], ["--address", self.address], deadline)
        self.started_s = round(time.monotonic() - started, 1)
        return self

    def stop(self) -> None:
        """End every process the ``ray start`` commands left (their process groups): SIGTERM, then SIGKILL. The
        raylets' logs are kept in ``work/logs/NODE`` (for a failure's post-mortem), their temp folder removed."""
        if _end_groups(self.procs) and self.temp is not None:
            for logs in self.temp.glob("*/session_*/logs"):
                shutil.copytree(logs, self.work / "logs" / logs.parent.parent.name, dirs_exist_ok=True)
            shutil.rmtree(self.temp, ignore_errors=True)

    def __enter__(self) -> Cluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()



def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover
        return True


def _end_groups(procs: list[subprocess.Popen]) -> bool:
    """SIGTERM the process groups led by ``procs``, SIGKILL what is left after a grace period; True if all ended.
    The leaders are reaped as they exit (a zombie leader would keep its group "alive")."""
    groups = [p.pid for p in procs]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = []
        for pgid in groups:
            try:
                os.killpg(pgid, sig)
                alive.append(pgid)
            except ProcessLookupError:
                pass
        if not alive:
            return True
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline:
            for p in procs:
                p.poll()
            if not any(_group_alive(g) for g in alive):
                break
            time.sleep(0.2)
    for p in procs:
        p.poll()
    return not any(_group_alive(g) for g in groups)
