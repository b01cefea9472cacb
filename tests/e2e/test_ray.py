"""The hotfix in Ray workers: a real Ray cluster on this machine (seven raylets on loopback addresses, each a "node"
with its own Python and environment), vLLM's model loaded in Ray actors pinned one per raylet, ``doctor --ray``.

Nodes (tests/support/ray_cluster.py; ray 2.60.0's CPU wheel, linked into throwaway overlays of the test environment):

========  ===========  =====================================================================================
node      address      what the node runs
========  ===========  =====================================================================================
node_a    127.0.0.2    the test environment + ray, nothing of the hotfix (the head)
node_b    127.0.0.3    the same
pip_a/b   .4 / .5      the same + the wheel pip-installed (route 1: nothing else to do)
bundle_a/b .6 / .7     the same as node_a + ``PYTHONPATH=<bundle>`` exported before ``ray start`` (route 2)
stock     127.0.0.8    the same as node_a (the stock actor's own raylet)
========  ===========  =====================================================================================

Route 3 is the driver's job ``runtime_env`` (``{"env_vars": {"PYTHONPATH": <bundle>}}``) on node_a and node_b, which
have nothing of the hotfix themselves.

**vLLM's Ray executor does not run on vLLM's CPU build** (every release 0.22-0.33: ``CpuPlatform`` has no
``ray_device_key``, and ``initialize_ray_cluster`` raises ``ValueError: current platform cpu does not support ray.``).
test_vllm_ray_executor_on_cpu asserts exactly that, on the live cluster, after vLLM has taken the driver's
runtime_env into ``ParallelConfig.ray_runtime_env``. So the routes are proven with plain Ray actors created the way
vLLM's ``RayExecutorV2`` (its default Ray executor) creates its workers (``num_cpus=0``, runtime_env: a copy of the
driver's job runtime_env plus vLLM's env_vars), one per raylet, pinned by the raylet's custom resource; each calls
``load_general_plugins()`` as vLLM's worker does, builds vLLM's ``MiniCPMV4_6ForConditionalGeneration`` and loads the
bundled tiny checkpoint through vLLM's ``load_weights``, and reports its ``qkv_proj`` against ``cat(q, k, v)`` of the
checkpoint's own tensors. The actors' pids are read from Ray's own log prefixes (``(MiniCPMLoader pid=N, ip=...)``)
on vLLM's own log lines; each must also carry the hotfix's summary line (``... pid N: patched ... qkv_loader ...``) with the same N. A stock actor (no
hotfix) on its own plain raylet fails with the ``k_proj`` error this release has.

Runs on one release, one where stock vLLM is broken (RAY_RELEASES); about 3-4 minutes on 2 cores, most of it the
vLLM imports of five actors and the engine driver at once (routes 1 and 2 load in one actor each, on pip_a and
bundle_a; route 3 in two, on node_a and node_b; pip_b and bundle_b are inspected by ``doctor --ray`` only). The jobs, the engine attempt and the doctor probes share one cluster, started once; each
actor that imports vLLM has a raylet of its own (tests/support/ray_cluster.py RAY_CONFIG says why).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from support.hotfix_log import patched_pids
from support import ray_cluster
from support.paths import REPO, TINY
from support.venvs import clean_env, overlay_env, pip_install

RAY_RELEASES = ("0.28.0",)
JOB_TIMEOUT_S = 480
DOCTOR_TIMEOUT_S = 180

pytestmark = [pytest.mark.ray, pytest.mark.placed(*RAY_RELEASES)]

ANSI = re.compile(r"\x1b\[[0-9;]*m")
#: Ray's prefix on a line an actor printed, as Ray's log monitor forwards it to the driver.
RAY_PREFIX = re.compile(r"^\((?P<cls>\w+) pid=(?P<pid>\d+)(?:, ip=(?P<ip>[0-9.]+))?\) (?P<msg>.*)$")
#: A line vLLM itself logs while building the model (vllm/config/model.py): marks a process that ran vLLM.
VLLM_OWN_LINE = "Resolved architecture: MiniCPMV4_6ForConditionalGeneration"




@pytest.fixture(scope="module")
def ray_work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ray")


@pytest.fixture(scope="module")
def plain_py(ray_work) -> Path:
    """The test environment + ray: a node with nothing of the hotfix."""
    python = overlay_env(ray_work / "plain-env")
    ray_cluster.link_ray(python)
    return python


@pytest.fixture(scope="module")
def pip_py(ray_work, wheel) -> Path:
    """The test environment + ray + the wheel, installed by ``uv pip install``."""
    python = overlay_env(ray_work / "pip-env")
    pip_install(python, str(wheel))
    ray_cluster.link_ray(python)
    return python


@pytest.fixture(scope="module")
def base_env() -> dict[str, str]:
    return clean_env(OMP_NUM_THREADS="1", RAY_DEDUP_LOGS="0")


@pytest.fixture(scope="module")
def cluster(ray_work, plain_py, pip_py, bundle_dir, base_env):
    nodes = [
        ray_cluster.Node("node_a", plain_py),
        ray_cluster.Node("node_b", plain_py),
        ray_cluster.Node("pip_a", pip_py),
        ray_cluster.Node("pip_b", pip_py),
        ray_cluster.Node("bundle_a", plain_py, {"PYTHONPATH": str(bundle_dir)}),
        ray_cluster.Node("bundle_b", plain_py, {"PYTHONPATH": str(bundle_dir)}),
        ray_cluster.Node("stock", plain_py),
    ]
    with ray_cluster.Cluster(ray_work / "cluster", nodes, base_env) as c:
        print(f"\nRay cluster at {c.address}: {len(nodes)} raylets started in {c.started_s} s")
        yield c


def _run(cmd: list[str], *, env: dict[str, str], cwd: Path, timeout: float) -> tuple[int | str, str, float]:
    started = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        rc: int | str = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        rc = "timeout"
    return rc, ANSI.sub("", out), round(time.monotonic() - started, 1)


@pytest.fixture(scope="module")
def jobs(cluster, ray_work, plain_py, pip_py, bundle_dir, base_env) -> dict[str, dict]:
    """Every Ray job at once, each its own driver process (a scratch folder, never the repository: Ray puts the
    driver's folders on the workers' ``sys.path``): ``{name: {"rc", "log", "seconds", "result"}}``."""
    scratch = ray_work / "drivers"
    scratch.mkdir()
    shutil.copy(REPO / "tests" / "support" / "ray_driver.py", scratch)
    runtime_env = json.dumps({"env_vars": {"PYTHONPATH": str(bundle_dir)}})
    specs = {
        # Routes 1 and 2 arm each node by itself (its own site-packages / PYTHONPATH): one actor each. Route 3 is
        # the one that crosses nodes (the driver's runtime_env reaching workers on other raylets): two actors.
        # ``doctor --ray`` below still inspects every raylet, pip_b and bundle_b included.
        "pip": (plain_py, "actors", "pip_a", "", {}),
        "bundle": (plain_py, "actors", "bundle_a", "", {}),
        "runtime_env": (plain_py, "actors", "node_a,node_b", runtime_env, {}),
        "stock": (plain_py, "actors", "stock", "", {}),
        # The driver that starts vLLM needs the hotfix itself (its processor fix): it runs where it is pip-installed.
        "engine": (pip_py, "engine", "-", runtime_env, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}),
    }
    env = {**base_env, "RAY_ADDRESS": cluster.address, "CKPT": str(TINY),
           "VLLM_CPU_PY": str(REPO / "vllm_minicpm_hotfix" / "cli" / "vllm_cpu.py")}

    def one(name: str) -> dict:
        python, mode, nodes, renv, extra = specs[name]
        out = scratch / f"{name}.json"
        rc, log, seconds = _run([str(python), str(scratch / "ray_driver.py"), mode, str(out), nodes, renv],
                                env={**env, **extra}, cwd=scratch, timeout=JOB_TIMEOUT_S)
        (scratch / f"{name}.log").write_text(log)
        result = json.loads(out.read_text()) if out.is_file() else None
        return {"rc": rc, "log": log, "seconds": seconds, "result": result}

    started = time.monotonic()
    with ThreadPoolExecutor(len(specs)) as pool:
        done = dict(zip(specs, pool.map(one, specs)))
    print(f"\nRay jobs: {time.monotonic() - started:.0f} s wall; "
          + ", ".join(f"{n} {d['seconds']} s (rc {d['rc']})" for n, d in done.items()))
    return done


def _job(jobs: dict, name: str) -> dict:
    job = jobs[name]
    assert job["rc"] == 0 and job["result"] is not None, f"{name} driver failed ({job['rc']}):\n{job['log'][-6000:]}"
    return job["result"]


def actor_lines(log: str) -> dict[int, list[str]]:
    """What each ``MiniCPMLoader`` actor printed, by the pid in Ray's prefix."""
    out: dict[int, list[str]] = {}
    for line in log.splitlines():
        m = RAY_PREFIX.match(line.strip())
        if m and m["cls"] == "MiniCPMLoader":
            out.setdefault(int(m["pid"]), []).append(m["msg"])
    return out


def worker_log_lines(cluster, pid: int) -> list[str]:
    """What the Ray worker process ``pid`` wrote to its raylet's own log files (``worker-*-PID.out`` / ``.err`` in
    the session folder under the raylets' ``--temp-dir``): what Ray's log monitor forwards to the driver, read at the
    source, so a line the monitor had not forwarded yet when the driver disconnected is still there."""
    paths = sorted(cluster.temp.glob(f"*/session_*/logs/worker-*-{pid}.*"))
    return [line for path in paths if path.suffix in (".out", ".err")
            for line in path.read_text(errors="replace").splitlines()]


def node_ip(cluster, name: str) -> str:
    return next(n.ip for n in cluster.nodes if n.name == name)


def assert_route(jobs: dict, cluster, name: str, nodes: tuple[str, ...], armed_by: str, origin: str) -> None:
    job = _job(jobs, name)
    actors = job["actors"]
    assert set(actors) == set(nodes)
    assert len({a["node_id"] for a in actors.values()}) == len(nodes), "two actors landed on one raylet"
    by_ray = actor_lines(jobs[name]["log"])
    # The actors that ran vLLM, by the pid Ray prints on vLLM's own log lines.
    vllm_pids = {pid for pid, lines in by_ray.items() if any(VLLM_OWN_LINE in m for m in lines)}
    # Ray forwards a worker's lines to the driver asynchronously: on a loaded machine the driver has disconnected
    # before some arrive (a fresh-clone run of 8b956d0 saw none of an actor's). Such an actor's own log file has them.
    vllm_pids |= {a["pid"] for a in actors.values()
                  if any(VLLM_OWN_LINE in line for line in worker_log_lines(cluster, a["pid"]))}
    assert vllm_pids == {a["pid"] for a in actors.values()}, (vllm_pids, jobs[name]["log"][-4000:])
    for node, a in actors.items():
        assert a.get("error") is None and a.get("load_error") is None, a
        assert a["node_ip"] == node_ip(cluster, node)
        assert a["qkv_equal"] == {"weight": True, "bias": True}, a
        assert a["armed_at_startup"] == armed_by, a
        assert a["hotfix_file"].startswith(origin), a["hotfix_file"]
        fixes = a["status"]["fixes"]
        assert fixes["qkv_loader"]["applied"] is True, a["status"]
        assert all(f["applied"] for f in fixes.values() if f["verdict"] == "broken"), a["status"]
        patched = [m for m in by_ray[a["pid"]] if patched_pids(m, "qkv_loader")]
        assert patched and all(patched_pids(m, "qkv_loader") == [str(a["pid"])] for m in patched), by_ray[a["pid"]]
        print(f"\n{name}: {node} ({a['node_ip']}) actor pid {a['pid']}: {patched[0][:140]}")


def test_stock_actor_fails_with_this_releases_error(jobs, expected):
    """No hotfix anywhere (a plain node, no runtime_env): vLLM's own loader fails on the split q/k/v."""
    a = _job(jobs, "stock")["actors"]["stock"]
    verdict, error = expected
    assert verdict == "broken" and error is not None, "the Ray tests need a release where stock vLLM is broken"
    assert error in a["load_error"], a
    assert a["armed_at_startup"] is None and a["pythonpath"] is None and "status" not in a
    assert "vllm-minicpm-hotfix:" not in jobs["stock"]["log"]


def test_route1_pip_installed_on_every_node(jobs, cluster, pip_py):
    from support.venvs import site_packages

    assert_route(jobs, cluster, "pip", ("pip_a",), "pth", str(site_packages(pip_py)))


def test_route2_bundle_on_pythonpath_before_ray_start(jobs, cluster, bundle_dir):
    assert_route(jobs, cluster, "bundle", ("bundle_a",), "sitecustomize", str(bundle_dir))


def test_route3_runtime_env_from_the_driver_only(jobs, cluster, bundle_dir, doctor_runs):
    """node_a and node_b have nothing of the hotfix (``doctor --ray`` without a runtime_env says so); the driver's
    ``ray.init(runtime_env={"env_vars": {"PYTHONPATH": bundle}})`` reaches the workers through vLLM's own recipe for
    their runtime_env."""
    rc, table = doctor_runs["table"]
    for node in cluster.nodes[:2]:
        assert "the hotfix is not installed on this node" in _row(table, node.ip), table
    assert_route(jobs, cluster, "runtime_env", ("node_a", "node_b"), "sitecustomize", str(bundle_dir))
    job = _job(jobs, "runtime_env")
    assert job["worker_runtime_env"] == {"env_vars": {"PYTHONPATH": str(bundle_dir),
                                                      "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}
    for a in job["actors"].values():
        assert a["pythonpath"] == str(bundle_dir)


def test_vllm_ray_executor_on_cpu(jobs, bundle_dir):
    """vLLM takes the driver's job runtime_env (so its worker actors would get the bundle), and then its Ray
    executor refuses the CPU platform: the exact error."""
    r = _job(jobs, "engine")
    log = jobs["engine"]["log"]
    assert r["executor_backend"] == "ray"
    assert r["ray_runtime_env"] == {"env_vars": {"PYTHONPATH": str(bundle_dir)}}
    assert "Using ray runtime env (env vars redacted): {'env_vars': {'PYTHONPATH': '***'}}" in log
    assert r.get("engine") is None, "vLLM's Ray executor started on CPU: test the engine route for real now"
    assert r["engine_error"] == "ValueError: current platform cpu does not support ray.", r
    assert "in initialize_ray_cluster" in r["engine_traceback"], r["engine_traceback"]
    print(f"\nvLLM + Ray on CPU: {r['engine_error']} ({r['engine_seconds']} s into LLM(...))")


def _doctor(cluster, pip_py, ray_work, base_env, *args: str) -> tuple[int | str, str]:
    cwd = ray_work / "doctor"
    cwd.mkdir(exist_ok=True)
    rc, out, seconds = _run([str(pip_py), "-m", "vllm_minicpm_hotfix", "doctor", "--ray", *args],
                            env={**base_env, "RAY_ADDRESS": cluster.address}, cwd=cwd, timeout=DOCTOR_TIMEOUT_S)
    print(f"\ndoctor --ray {' '.join(args)}: rc {rc}, {seconds} s\n{out[-3000:]}")
    return rc, out


def _json(out: str) -> dict:
    return json.loads(out[out.index("{"):])


@pytest.fixture(scope="module")
def doctor_runs(cluster, pip_py, ray_work, base_env, bundle_dir, jobs) -> dict[str, tuple]:
    """``doctor --ray`` as a user runs it (the table), and with the runtime_envs a driver could pass (JSON)."""
    b = str(bundle_dir)
    variants = {
        "table": (),
        "working_dir": ("--json", "--ray-runtime-env", json.dumps({"working_dir": b})),
        "py_modules": ("--json", "--ray-runtime-env", json.dumps({"py_modules": [b]})),
    }
    with ThreadPoolExecutor(len(variants)) as pool:
        runs = pool.map(lambda args: _doctor(cluster, pip_py, ray_work, base_env, *args), variants.values())
        return dict(zip(variants, runs))


def _row(table: str, ip: str) -> str:
    rows = [line for line in table.splitlines() if line.strip().startswith(ip + " ")]
    assert len(rows) == 1, table
    return rows[0]


def test_doctor_ray_one_row_per_node(doctor_runs, cluster):
    rc, out = doctor_runs["table"]
    assert rc == 1, out
    rows = {n.name: _row(out, n.ip) for n in cluster.nodes}
    for name in ("node_a", "node_b", "stock"):
        assert " FAIL " in rows[name] and "the hotfix is not installed on this node" in rows[name], out
    for name in ("pip_a", "pip_b"):
        assert " OK " in rows[name] and "yes, start-up (pth)" in rows[name] and ".pth" in rows[name], out
    for name in ("bundle_a", "bundle_b"):
        assert " OK " in rows[name] and "yes, start-up (sitecustomize)" in rows[name], out
    last = out.strip().splitlines()[-1]
    assert last.startswith("FAIL: 3 of 7 node(s) would run vLLM unpatched (127.0.0.2, 127.0.0.3, 127.0.0.8)"), last


def _by_node(cluster, report: dict) -> dict[str, dict]:
    by_ip = {r["address"]: r for r in report["nodes"]}
    assert set(by_ip) == {n.ip for n in cluster.nodes}
    return {n.name: by_ip[n.ip] for n in cluster.nodes}


def test_doctor_ray_working_dir_carries_the_bundle(doctor_runs, cluster, release):
    """``--ray-runtime-env '{"working_dir": BUNDLE}'`` (JSON): Ray ships the folder from the driver to every node
    and puts it on the workers' PYTHONPATH, so its sitecustomize arms even node_a and node_b. The facts per node:
    what armed it and from where, the .pth and entry point of the pip nodes, wrapt, the mode, vLLM."""
    rc, out = doctor_runs["working_dir"]
    assert rc == 0, out
    nodes = _by_node(cluster, _json(out))
    for name, r in nodes.items():
        assert r["activates"] is True and r["mode"] == "auto" and r["vllm"] == [f"vllm-cpu {release}"], r
        assert r["resources"] == [name] and r["wrapt"]["source"] == "installed", r
    for name in ("pip_a", "pip_b"):
        r = nodes[name]
        assert r["armed_by"] == "pth" and r["pth"] and r["entry_point"] == "vllm_minicpm_hotfix.plugin:register", r
    for name in ("node_a", "node_b", "bundle_a", "bundle_b", "stock"):
        r = nodes[name]
        assert r["armed_by"] == "sitecustomize" and r["sitecustomize_ours"] and not r["pth"], r
        assert "/runtime_resources/working_dir_files/" in r["package"] and r["entry_point"] is None, r


def test_doctor_ray_py_modules_does_not_carry_it(doctor_runs, cluster):
    """``py_modules: [BUNDLE]``: the folder becomes a package below a path entry; nothing runs its sitecustomize."""
    rc, out = doctor_runs["py_modules"]
    assert rc == 1, out
    for name in ("node_a", "node_b", "stock"):
        r = _by_node(cluster, _json(out))[name]
        assert r["activates"] is False and r["armed_by"] is None and r["package"] is None, r


def test_doctor_ray_names_an_address_nothing_answers_at(pip_py, ray_work, base_env):
    """No cluster there: one line, at once (``ray.init`` itself would retry for minutes)."""
    address = f"127.0.0.9:{ray_cluster.free_port()}"
    rc, out, seconds = _run([str(pip_py), "-m", "vllm_minicpm_hotfix", "doctor", "--ray", "--ray-address", address],
                            env=base_env, cwd=ray_work, timeout=60)
    assert rc == 1 and seconds < 30, (rc, seconds, out)
    assert out.strip().splitlines()[-1].startswith(f"FAIL: no Ray cluster answers at {address} (Connection"), out
