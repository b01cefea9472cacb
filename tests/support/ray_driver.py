"""A Ray driver for tests/e2e/test_ray.py, run with the cluster's Python (an overlay venv that has ray) from a scratch
folder -- never from the repository: Ray puts the driver's script folder and working directory on every worker's
``sys.path``, which would hand the workers this repository's package.

``python ray_driver.py actors RESULT.json NODES [RUNTIME_ENV_JSON]``
    Connects to ``RAY_ADDRESS`` (with the runtime_env, if given, as the job's -- what ``ray.init(runtime_env=...)``
    in a vLLM driver does) and starts one ``MiniCPMLoader`` actor on each raylet named in NODES (comma-separated),
    pinned by a share of the raylet's custom resource of that name (a share, so that other jobs' actors can be
    there at the same time), with the options vLLM's ``RayExecutorV2`` (the default Ray executor of every release
    0.22-0.33) gives its worker actors: ``num_cpus=0`` and, from ``_build_runtime_env``, a copy of the driver's job
    runtime_env (``ParallelConfig.ray_runtime_env``, which vLLM reads from ``ray.get_runtime_context().runtime_env``)
    with vLLM's own ``env_vars`` added. Each actor calls ``vllm.plugins.load_general_plugins()`` as vLLM's worker does
    (``WorkerWrapperBase.init_worker``), then builds vLLM's ``MiniCPMV4_6ForConditionalGeneration`` on CPU and loads the
    checkpoint with ``model.load_weights`` (``vllm_minicpm_hotfix/cli/vllm_cpu.py``'s ``build_vllm_model``, whose source
    the driver hands over with that of ``vllm_minicpm_hotfix/checkpoint.py``, the one module it imports, so the
    actor needs nothing of the hotfix on its node), then compares the vit_merger
    ``qkv_proj`` with ``cat(q, k, v)`` of the checkpoint's own tensors (read with safetensors). The actors' log lines
    reach this process's stdout through Ray, prefixed ``(MiniCPMLoader pid=N, ip=IP)``; the results go to RESULT.json.

``python ray_driver.py engine RESULT.json - [RUNTIME_ENV_JSON]``
    ``ray.init`` as above, then ``vllm.LLM(CKPT, distributed_executor_backend="ray", tensor_parallel_size=2, ...)``:
    records the ``ParallelConfig.ray_runtime_env`` vLLM derived from the driver's job and what the engine raised.
    The test runs it with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (EngineCore in this process: one ``import vllm``
    less; the executor's ``initialize_ray_cluster`` is the same code either way).

Environment: ``RAY_ADDRESS``, ``CKPT`` (checkpoint folder), ``VLLM_CPU_PY`` (path of vllm_cpu.py).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

PREFIX = "model.vision_tower.vit_merger.self_attn."
#: What vLLM's Ray executors add to each worker actor's runtime_env on CUDA
#: (``current_platform.ray_noset_device_env_vars``).
ACTOR_ENV_VARS = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}


def worker_runtime_env(ray) -> dict:
    """``RayExecutorV2._build_runtime_env`` (vllm/v1/executor/ray_executor_v2.py), with the job's runtime_env as
    vLLM's ``EngineArgs.create_engine_config`` reads it."""
    import copy

    base = ray.get_runtime_context().runtime_env
    runtime_env = copy.deepcopy(dict(base)) if base else {}
    runtime_env.setdefault("env_vars", {}).update(ACTOR_ENV_VARS)
    return runtime_env


def _runtime_env() -> dict | None:
    return json.loads(sys.argv[4]) if len(sys.argv) > 4 and sys.argv[4] else None


def actors(out: str) -> None:
    import ray

    ray.init(address=os.environ["RAY_ADDRESS"], runtime_env=_runtime_env(), log_to_driver=True)

    @ray.remote
    class MiniCPMLoader:
        def load(self, ckpt: str, sources: dict) -> dict:
            import types

            facts: dict = {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                           "pythonpath": os.environ.get("PYTHONPATH"), "cwd": os.getcwd()}
            arm = sys.modules.get("_vllm_minicpm_hotfix_arm")
            facts["armed_at_startup"] = getattr(arm, "source", None)
            try:
                # vllm_cpu.py imports ..checkpoint: both run as modules of a stand-in package (not the hotfix's name)
                for pkg in ("ray_test_hotfix", "ray_test_hotfix.cli"):
                    sys.modules[pkg] = types.ModuleType(pkg)
                    sys.modules[pkg].__path__ = []
                for name, src in sources.items():  # the checkpoint reader first
                    mod = sys.modules[name] = types.ModuleType(name)
                    mod.__package__ = name.rpartition(".")[0]
                    exec(compile(src, name.rpartition(".")[2] + ".py", "exec"), mod.__dict__)  # noqa: S102 - test code
                vllm_cpu = sys.modules["ray_test_hotfix.cli.vllm_cpu"]
                import torch
                import vllm
                from vllm.plugins import load_general_plugins

                facts["vllm"] = vllm.__version__
                load_general_plugins()
                started = time.monotonic()
                try:
                    model = vllm_cpu.build_vllm_model(ckpt)
                except Exception as exc:  # noqa: BLE001 - what stock vLLM raises is the point
                    facts["load_error"] = f"{type(exc).__name__}: {exc}"
                else:
                    facts["load_seconds"] = round(time.monotonic() - started, 2)
                    ck = vllm_cpu.checkpoint_tensors(ckpt)
                    qkv = model.vit_merger.self_attn.qkv_proj
                    facts["qkv_equal"] = {
                        s: bool(torch.equal(getattr(qkv, s).detach(),
                                            torch.cat([ck[f"{PREFIX}{x}_proj.{s}"] for x in "qkv"])))
                        for s in ("weight", "bias")
                    }
            except Exception:  # noqa: BLE001
                facts["error"] = traceback.format_exc()
            hotfix = sys.modules.get("vllm_minicpm_hotfix")
            if hotfix is not None:
                facts["hotfix_file"] = hotfix.__file__
                facts["status"] = hotfix.status()
                boot = sys.modules.get("vllm_minicpm_hotfix._bootstrap")
                facts["activations"] = list(getattr(boot, "activations", []))
            sys.stdout.flush()
            sys.stderr.flush()
            return facts

    vllm_cpu_py = os.environ["VLLM_CPU_PY"]
    sources = {"ray_test_hotfix.checkpoint": os.path.join(os.path.dirname(vllm_cpu_py), os.pardir, "checkpoint.py"),
               "ray_test_hotfix.cli.vllm_cpu": vllm_cpu_py}
    sources = {name: open(path, encoding="utf-8").read() for name, path in sources.items()}
    nodes = sys.argv[3].split(",")
    runtime_env = worker_runtime_env(ray)
    handles = [
        MiniCPMLoader.options(num_cpus=0, resources={node: 0.01}, runtime_env=runtime_env).remote()
        for node in nodes
    ]
    results = dict(zip(nodes, ray.get([h.load.remote(os.environ["CKPT"], sources) for h in handles], timeout=600)))
    addresses = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    for r in results.values():
        r["node_ip"] = addresses.get(r["node_id"])
    time.sleep(1.5)  # let Ray's log monitor forward the actors' last lines before we disconnect
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"runtime_env": _runtime_env(), "worker_runtime_env": runtime_env, "actors": results}, f,
                  indent=1, default=str)
    ray.shutdown()


def engine(out: str) -> None:
    import ray

    ray.init(address=os.environ["RAY_ADDRESS"], runtime_env=_runtime_env(), log_to_driver=True)
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    kwargs = dict(model=os.environ["CKPT"], distributed_executor_backend="ray", tensor_parallel_size=2,
                  enforce_eager=True, dtype="bfloat16", max_model_len=1024, gpu_memory_utilization=0.1,
                  mamba_ssm_cache_dtype="float32")
    result: dict = {}
    try:
        cfg = EngineArgs(**kwargs).create_engine_config()
        env = cfg.parallel_config.ray_runtime_env
        result["ray_runtime_env"] = env.to_dict() if env is not None else None
        result["executor_backend"] = cfg.parallel_config.distributed_executor_backend
    except Exception as exc:  # noqa: BLE001
        result["config_error"] = f"{type(exc).__name__}: {exc}"
    started = time.monotonic()
    try:
        llm = LLM(**kwargs)
        result["engine"] = "started"
        del llm
    except Exception as exc:  # noqa: BLE001 - the error is the result
        result["engine_error"] = f"{type(exc).__name__}: {exc}"
        result["engine_traceback"] = traceback.format_exc()
    result["engine_seconds"] = round(time.monotonic() - started, 1)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1, default=str)
    ray.shutdown()


if __name__ == "__main__":
    {"actors": actors, "engine": engine}[sys.argv[1]](sys.argv[2])
