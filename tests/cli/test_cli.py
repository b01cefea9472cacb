"""``vllm-minicpm-hotfix doctor`` and ``verify`` as an operator runs them: real processes, real vLLM on CPU, no mocks.

Set-ups (each a way the hotfix can be present in an environment, built once per session):

* ``none``   -- this test environment as it is: the package is only on the command's own ``sys.path`` (nothing in
  site-packages, nothing on PYTHONPATH), so no activation path exists;
* ``pip``    -- a throwaway overlay venv whose site-packages points (``.pth``) at this environment's site-packages,
  with ``uv pip install --no-deps <repo>`` into it: the ``vllm.general_plugins`` entry point and the
  ``vllm-minicpm-hotfix.pth`` bootstrap, run through its ``vllm-minicpm-hotfix`` console script;
* ``off``    -- ``pip`` with ``VLLM_MINICPM_HOTFIX=off``;
* ``bundle`` -- ``vllm-minicpm-hotfix bundle DIR`` and ``PYTHONPATH=DIR``, run as ``python -m vllm_minicpm_hotfix``
  (the bundle's copy).

What each release should give comes from ``tests/support/expected.py`` (the q/k/v verdict and stock vLLM's load error) and
from the installed transformers (whether its image processor takes ``downsample_mode``, which no vLLM 0.22-0.33
passes). Each ``doctor`` with vLLM present and each ``verify`` that gets past its input checks is one fresh vLLM
process (~20-30 s); bad-input ``verify`` runs and ``doctor`` without vLLM never import vLLM.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
from support.paths import REPO, TINY
from support.placement import FULL_ENVS
from support.programs import program, run_program, site_copy
from support.stop_checkpoints import token_ids
from support.venvs import site_packages
from vllm_minicpm_hotfix.cli import doctor, verify

pytestmark = pytest.mark.placed(*FULL_ENVS)

PREFIX = "model.vision_tower.vit_merger.self_attn."


def run_from(folder: Path) -> list[str]:
    """What follows the interpreter to run the CLI from the package in ``folder``: tests/programs/cli_from.py, which
    puts the folder on sys.path itself (no activation path sees it) and leaves sys.path as ``python -c`` would."""
    return [str(program("cli_from")), str(folder)]


def source_copy(dst: Path, *, package_only: bool = False) -> Path:
    """The repository's package (and, unless ``package_only``, what a build needs) copied to ``dst``: builds write
    ``build/`` and ``*.egg-info`` next to the sources, and an egg-info on sys.path registers the entry point."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist")
    dst.mkdir(parents=True)
    shutil.copytree(REPO / "vllm_minicpm_hotfix", dst / "vllm_minicpm_hotfix", ignore=ignore)
    if not package_only:
        for name in ("pyproject.toml", "README.md", "sitecustomize.py", "_vllm_minicpm_hotfix_arm.py",
                     "vllm-minicpm-hotfix.pth", "vllm-minicpm-hotfix.start"):
            if (REPO / name).exists():
                shutil.copy(REPO / name, dst / name)
    return dst

HUB_ID = "local-test/tiny-minicpm-v46-sharded"
TIMEOUT = 900


# --------------------------------------------------------------------------------------------------------------------
# Set-ups
# --------------------------------------------------------------------------------------------------------------------


class Setups:
    def __init__(self, tmp: Path, vllm_cache: Path) -> None:
        self.tmp = tmp
        self.vllm_cache = vllm_cache
        self.cwd = tmp / "cwd"  # a neutral working directory: the repository is not on anyone's sys.path by accident
        self.cwd.mkdir()
        self.pkg = source_copy(tmp / "pkg", package_only=True)  # the "none" set-up runs this copy
        self.src = source_copy(tmp / "src")  # built into the overlay, and the bundle is written from it
        self._bundle: Path | None = None
        self._overlay: Path | None = None
        # An image's own sitecustomize (Debian/Ubuntu Pythons and many images ship one): after the bundle on
        # PYTHONPATH, so the bundle's sitecustomize runs first and must chain to it.
        self.image_site = site_copy("image_site", tmp / "image-site")

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "VLLM_MINICPM_HOTFIX", "VLLM_PLUGINS", "VLLM_MINICPM_HOTFIX_REPORT")}
        # VLLM_CACHE_ROOT: vLLM's model-info cache is keyed per release; other releases' runs on this machine would
        # otherwise overwrite it and every ModelConfig would re-inspect the model class in a subprocess (~30 s).
        env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CACHE_ROOT=str(self.vllm_cache))
        env.update(extra)
        return env

    @property
    def bundle(self) -> Path:
        if self._bundle is None:
            out = self.tmp / "bundle"
            proc = run_program("cli_from", self.src, "bundle", out, cwd=self.cwd, env=self.env(), timeout=120,
                               check=False)
            assert proc.returncode == 0, proc.stdout + proc.stderr
            doctor_module = out / "vllm_minicpm_hotfix" / "cli" / "doctor" / "__init__.py"
            assert (out / "sitecustomize.py").is_file() and doctor_module.is_file()
            self._bundle = out
        return self._bundle

    @property
    def overlay(self) -> Path:
        """A venv layered over this environment, with the package pip-installed (not editable) into it only."""
        if self._overlay is None:
            uv = shutil.which("uv")
            if uv is None:
                pytest.fail("uv is needed to build the pip-installed overlay environment (scripts/cpu-env installs it)")
            venv = self.tmp / "overlay"
            subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(venv)], check=True,
                           capture_output=True, timeout=120)
            py = venv / "bin" / "python"
            site = site_packages(py)
            Path(site, "_shared_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
            proc = subprocess.run([uv, "pip", "install", "-q", "--python", str(py), "--no-deps", str(self.src)],
                                  capture_output=True, text=True, timeout=600)
            assert proc.returncode == 0, proc.stderr[-3000:]
            assert Path(site, "vllm-minicpm-hotfix.pth").is_file(), "the wheel did not install its .pth"
            self._overlay = venv
        return self._overlay

    def command(self, setup: str, args: list[str], **extra_env: str) -> tuple[list[str], dict[str, str]]:
        if setup == "none":
            return [sys.executable, *run_from(self.pkg), *args], self.env(**extra_env)
        if setup == "bundle":
            pythonpath = os.pathsep.join([str(self.bundle), str(self.image_site)])
            return [sys.executable, "-m", "vllm_minicpm_hotfix", *args], self.env(PYTHONPATH=pythonpath, **extra_env)
        if setup in ("pip", "off"):
            env = self.env(**extra_env)
            if setup == "off":
                env["VLLM_MINICPM_HOTFIX"] = "off"
            return [str(self.overlay / "bin" / "vllm-minicpm-hotfix"), *args], env
        raise ValueError(setup)

    def run(self, setup: str, args: list[str], **extra_env: str) -> subprocess.CompletedProcess:
        cmd, env = self.command(setup, args, **extra_env)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=self.cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT,
                              stdin=subprocess.DEVNULL)
        proc.seconds = time.perf_counter() - t0
        print(f"\n$ [{setup}] vllm-minicpm-hotfix {' '.join(args)}  -> exit {proc.returncode} in "
              f"{proc.seconds:.1f} s\n{proc.stdout}{proc.stderr[-2000:]}")
        return proc


@pytest.fixture(scope="session")
def setups(tmp_path_factory) -> Setups:
    return Setups(tmp_path_factory.mktemp("cli"), tmp_path_factory.mktemp("vllm-cache"))


@pytest.fixture(scope="session")
def processor_expected() -> str:
    """The image-processor fix's verdict for stock vLLM here: every vLLM 0.22-0.33 calls transformers'
    ``find_best_resize`` without ``downsample_mode``, which is broken exactly when transformers takes it (>= 5.21.0,
    measured)."""
    from transformers.models.minicpmv4_6.image_processing_minicpmv4_6 import (
        MiniCPMV4_6ImageProcessor,
    )

    takes = "downsample_mode" in inspect.signature(MiniCPMV4_6ImageProcessor.find_best_resize).parameters
    return "broken" if takes else "correct"


@pytest.fixture(scope="session")
def wrapt_c_extension() -> bool:
    import wrapt.__wrapt__

    return bool(wrapt.__wrapt__._using_c_extension)


_REPORTS: dict[str, dict] = {}


# --------------------------------------------------------------------------------------------------------------------
# doctor
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("setup", ["none", "pip", "off", "bundle"])
def test_doctor(setups, setup, release, expected, processor_expected, wrapt_c_extension):
    proc = setups.run(setup, ["doctor", "--json"])
    report = json.loads(proc.stdout)
    _REPORTS[setup] = report
    from support import expected as table
    from vllm_minicpm_hotfix.fixes import REGISTRY

    qkv_broken = expected[0] == "broken"
    proc_broken = processor_expected == "broken"
    active = setup in ("pip", "bundle")
    # doctor's verdict: every fix not scoped to some checkpoints (SCOPE) must be correct, stock or patched.
    env = table.installed_environment()
    needs = [f.NAME for f in REGISTRY if not getattr(f, "SCOPE", None) and table.verdict(f.NAME, env) != "correct"]
    want_ok = active or not needs

    assert proc.returncode == (0 if want_ok else 1), report["summary"]
    assert report["ok"] is want_ok
    assert report["summary"].startswith("OK: " if want_ok else "FAIL: ") and "\n" not in report["summary"]
    assert report["vllm"]["installed"] and report["vllm"]["version"].split("+")[0] == release
    assert report["mode"]["value"] == ("off" if setup == "off" else "auto")

    child = report["child"]
    assert child["vllm_version"].split("+")[0] == release and child["module"] is True
    steps = child["steps"]
    assert list(steps) == ["startup", "import vllm", "plugins", "model module"]
    assert steps["model module"]["hook_installed"] is active
    activations = steps["model module"]["activations"]

    fixes = report["fixes"]
    qkv, pf = fixes["qkv_loader"], fixes["processor_downsample_mode"]
    assert qkv["stock"] == expected[0], qkv
    if expected[1]:
        assert expected[1] in qkv["stock_reason"]
    assert qkv["applied"] is (active and qkv_broken)
    assert qkv["now"] == ("broken" if qkv_broken and not active else "correct")
    assert pf["stock"] == processor_expected and pf["applied"] is (active and proc_broken)
    assert (child["status"] is not None) is (setup != "none")  # the package was imported by an activation path
    if active:
        st = child["status"]
        assert st["hook_installed"] and st["module_imported"] and st["fixes"]["qkv_loader"]["verdict"] == expected[0]

    act = report["activation"]
    pip_like = setup in ("pip", "off")
    assert act["entry_point"]["registered"] is pip_like
    assert bool(act["pth"]["files"]) is pip_like
    assert act["startup"]["armed_by"] == {"pip": "pth", "bundle": "sitecustomize"}.get(setup)
    if pip_like:
        assert act["pth"]["files"][0].endswith("site-packages/vllm-minicpm-hotfix.pth")
        # The .start file is installed too; Pythons before PEP 829 (3.15) arm through the .pth.
        assert act["pth"]["start_files"][0].endswith("site-packages/vllm-minicpm-hotfix.start")
        runs = "start" if sys.version_info >= (3, 15) else "pth"
        assert act["pth"]["runs"] == (runs if setup == "pip" else None) and not act["pth"]["outside_site_dirs"]
        assert act["entry_point"]["entries"][0]["value"] == "vllm_minicpm_hotfix.plugin:register"
    if setup == "pip":
        assert activations[0] == "pth" and "plugin" in activations  # the .pth on `import vllm`, then the plugin
    elif setup == "bundle":
        assert activations == ["sitecustomize"]
        sc = act["sitecustomize"]
        image = str(setups.image_site / "sitecustomize.py")
        assert sc["ours"] == sc["ran_at_startup"] == str(setups.bundle / "sitecustomize.py") and sc["active"]
        assert sc["chained_at_startup"] == sc["chains_to"] == image and sc["shadowed_by"] is None
        assert act["bundles"][0]["path"] == str(setups.bundle)
        assert child["sitecustomize"] == {"file": str(setups.bundle / "sitecustomize.py"), "ours": True,
                                          "chained": image}
    else:
        assert activations == []
    if setup != "bundle":
        assert act["sitecustomize"]["ours"] is None and act["bundles"] == []

    if active:
        used = report["wrapt"]["used_in_vllm_process"]
        assert used["source"] == "installed" and used["c_extension"] is wrapt_c_extension

    # The backports: a row each where the hook ran in doctor's vLLM process, and the OK line names them.
    backport_rows = {r["check"]: r for r in report["checks"] if r["check"].startswith("backport ")}
    if active:
        own = table.backport_verdict("minicpmv4_7", env) == "correct"
        says = "vLLM's own" if own else "registered by the hotfix"
        row = backport_rows["backport minicpmv4_7"]
        assert row["status"] == "OK" and row["detail"].startswith(f"MiniCPM-V 4.7: {says} ("), row
        assert f"; MiniCPM-V 4.7: {says}" in report["summary"], report["summary"]
        # Where 4.7 is the backport's, its "not needed" rows judge the hotfix's classes, and say so (they read as
        # vLLM's own otherwise); where vLLM has 4.7 they never name the backport.
        member_rows = [r for r in report["checks"] if r["check"].endswith("[MiniCPM-V 4.7]")
                       and r["detail"].startswith("not needed")]
        assert member_rows, [r["check"] for r in report["checks"]]
        named = [r["detail"].startswith("not needed: MiniCPM-V 4.7 by the hotfix's backport (vLLM has none here): ")
                 for r in member_rows]
        assert named == [not own] * len(member_rows), member_rows
        # MiniCPM-OCR: registered by the hotfix where transformers has minicpm_ocr (0.28.0 with 5.24.0); 0.32.0's
        # transformers (5.19.0) has none: not served, and why.
        ocr = backport_rows["backport minicpm_ocr"]
        if table.backport_verdict("minicpm_ocr", env) == "missing":
            assert ocr["status"] == "OK" and ocr["detail"].startswith("MiniCPM-OCR: registered by the hotfix ("), ocr
            assert report["summary"].endswith("; MiniCPM-OCR: registered by the hotfix"), report["summary"]
        else:
            assert ocr["status"] == "-" and ocr["detail"].startswith("MiniCPM-OCR: not served here (transformers "), ocr
            assert "has no MiniCPMOcrConfig" in ocr["detail"], ocr
    else:
        assert backport_rows == {}, backport_rows

    if not want_ok:
        if setup == "off":
            assert "VLLM_MINICPM_HOTFIX=off" in report["summary"]
        else:
            assert "not installed in this environment" in report["summary"] and "pip install" in report["summary"]
    else:
        assert ("hotfix active" if active else "hotfix not active") in report["summary"]
    # The closing sentence, from the recorded run (docs/results/test-run.json) and this environment's row of
    # tests/support/expected.py: is the package still needed, and does a measured release need none of what is needed here.
    needed = [f.NAME for f in REGISTRY if table.verdict(f.NAME, env) != "correct"]
    assert report["removal"]["needed"] == needed
    run = json.loads((REPO / "docs" / "results" / "test-run.json").read_text())
    fits = [e for e in run["environments"] if all(e["verdicts"].get(n) == "correct" for n in needed)]
    sentence = report["removal"]["sentence"]
    if not needed:
        assert sentence == "nothing to fix on this vLLM: the package can be removed"
    elif not fits:
        assert sentence == "needed, and no measured release fixes all of them"
    else:
        assert re.fullmatch(rf"needed for {len(needed)} fix(es)?; vLLM \S+ \(measured, transformers \S+\) needs none "
                            r"of them", sentence), sentence
        assert report["removal"]["release"]["environment"] in [e["environment"] for e in fits]
    assert len(report["summary"]) < 300, report["summary"]
    rows = {r["check"]: r for r in report["checks"]}
    assert not [r for r in report["checks"] if "not needed: not needed" in r["detail"]]
    assert rows["qkv_loader"]["status"] == ("OK" if (active or not qkv_broken) else "FAIL")
    # The completeness guard is scoped (a check, not a repair): needed and unapplied is a WARN row, never the verdict.
    guard_needed = table.verdict("qkv_completeness_guard", env) == "broken"
    guard = fixes["qkv_completeness_guard"]
    assert guard["stock"] == ("broken" if guard_needed else "correct") and guard["applied"] is (active and guard_needed)
    assert rows["qkv_completeness_guard"]["status"] == ("WARN" if guard_needed and not active else "OK")
    if guard_needed and not active:
        assert "vllm-minicpm-hotfix verify --model DIR" in rows["qkv_completeness_guard"]["detail"]
    # quantized_vision is probed at first use (the first quantized model construction): the hook's record says so
    # in vLLM's processes, and doctor's child probes it there as that first use would (pinned verdict, applied).
    qv = fixes["quantized_vision"]
    assert qv["first_use"] is active and qv["stock"] == table.verdict("quantized_vision", env), qv
    assert qv["applied"] is (active and qv["stock"] == "broken") and qv["now"] == ("correct" if active else qv["stock"])
    if active:
        assert child["status"]["fixes"]["quantized_vision"]["verdict"] == "deferred"
        assert rows["quantized_vision"]["detail"].startswith("probed at first use"), rows["quantized_vision"]


def test_doctor_text_table(setups):
    """The terminal form of a report (here from the bundle run above, or computed afresh): a table, no colour codes
    off a terminal, the verdict, and the closing sentence as the last line."""
    import io
    from contextlib import redirect_stdout

    report = _REPORTS.get("bundle")
    if report is None:
        report = json.loads(setups.run("bundle", ["doctor", "--json"]).stdout)
    buf = io.StringIO()
    with redirect_stdout(buf):
        doctor.render(report)
    lines = buf.getvalue().splitlines()
    assert lines[0] == "vllm-minicpm-hotfix doctor"
    assert lines[1].split() == ["check", "status", "detail"]
    checks = [ln.split()[0] for ln in lines[2:-2]]
    for check in ("python", "vLLM", "mode", "entry", "VLLM_PLUGINS", ".pth", "sitecustomize", "bundle", "wrapt",
                  "qkv_loader"):
        assert check in checks, checks
    assert lines[-2:] == [report["summary"], report["removal"]["sentence"]]  # the verdict, then whether still needed
    assert "\x1b[" not in buf.getvalue()


def test_doctor_without_vllm_is_cheap(setups, tmp_path):
    """A Python with no vLLM: no child process, exit 1, one line saying so -- in a couple of seconds."""
    uv = shutil.which("uv")
    assert uv, "uv is needed (scripts/cpu-env installs it)"
    bare = tmp_path / "bare"
    subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(bare)], check=True, capture_output=True)
    t0 = time.perf_counter()
    proc = run_program("cli_from", setups.pkg, "doctor", python=bare / "bin" / "python", cwd=setups.cwd,
                       env=setups.env(), timeout=60, check=False)
    seconds = time.perf_counter() - t0
    print(proc.stdout, proc.stderr)
    assert proc.returncode == 1
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("FAIL: vLLM is not installed for ")
    assert "absent" in proc.stdout and "vLLM process" not in proc.stdout
    assert "torch" not in proc.stderr and seconds < 15, seconds
    proc = run_program("cli_from", setups.pkg, "doctor", "--json", python=bare / "bin" / "python", cwd=setups.cwd,
                       env=setups.env(VLLM_PLUGINS="other"), timeout=60, check=False)
    report = json.loads(proc.stdout)
    assert proc.returncode == 1 and report["ok"] is False and report["child"] is None
    assert report["vllm"] == {"installed": False, "distributions": [], "version": None}
    assert report["activation"]["vllm_plugins"]["allows_ours"] is False
    assert report["wrapt"]["found"] is False


# --------------------------------------------------------------------------------------------------------------------
# verify: checkpoints
# --------------------------------------------------------------------------------------------------------------------


def _copy_without_weights(dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in TINY.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    return dst


def _tiny_tensors() -> dict:
    from safetensors.torch import load_file

    return load_file(str(TINY / "model.safetensors"))


@pytest.fixture(scope="session")
def hub_cache(tmp_path_factory) -> Path:
    """A huggingface_hub cache holding ``local-test/tiny-minicpm-v46-sharded``: the tiny checkpoint re-split into
    three safetensors shards with a ``model.safetensors.index.json``, q_proj in one shard and k/v in another (so vLLM
    hands the self-attention its q/k/v in separate calls)."""
    from safetensors.torch import save_file

    cache = tmp_path_factory.mktemp("hf-hub")
    repo = cache / ("models--" + HUB_ID.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snap = _copy_without_weights(repo / "snapshots" / commit)
    tensors = _tiny_tensors()
    shards: list[dict] = [{}, {}, {}]
    for name, t in tensors.items():
        if name.startswith(PREFIX + "q_proj"):
            shards[0][name] = t
        elif name.startswith((PREFIX + "k_proj", PREFIX + "v_proj")):
            shards[1][name] = t
        elif name.startswith("model.language_model."):
            shards[0][name] = t
        else:
            shards[2][name] = t
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(snap / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
    (snap / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return cache


@pytest.fixture(scope="session")
def corrupted(tmp_path_factory) -> Path:
    """The tiny checkpoint with NaNs written into k_proj.weight."""
    from safetensors.torch import save_file

    out = _copy_without_weights(tmp_path_factory.mktemp("corrupted") / "ckpt")
    tensors = _tiny_tensors()
    tensors[PREFIX + "k_proj.weight"][3, :5] = float("nan")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _rows(stdout: str) -> dict[str, str]:
    """The result table: parameter name -> the rest of its line."""
    out = {}
    for line in stdout.splitlines():
        parts = line.split(None, 1)
        if parts and parts[0].startswith("vit_merger.self_attn."):
            out[parts[0]] = parts[1]
    return out


PARAMS = [f"vit_merger.self_attn.{m}.{s}" for m in ("qkv_proj", "out_proj") for s in ("weight", "bias")]


def test_verify_tiny_stock(setups, expected, release):
    """No argument: the bundled tiny checkpoint, in this environment as it is (no activation path): stock vLLM's own
    load -- the reported error where the release is broken, bit-exact where it is correct."""
    proc = setups.run("none", ["verify"])
    out = proc.stdout
    last = out.strip().splitlines()[-1]
    assert "Traceback" not in out + proc.stderr
    assert "hotfix      not active" in out and f"bundled tiny checkpoint ({setups.pkg}" in out
    # Printed before the load, so on a broken release too: the bundled checkpoint's tokenizer eos and generation
    # config both name <|im_end|>, the token its template closes a turn with (tests/cli/test_stop_tokens.py).
    im_end = token_ids(TINY)["<|im_end|>"]
    assert f"  stop ids    OK vLLM stops on [{im_end} <|im_end|>] (tokenizer eos {im_end} <|im_end|>; " in out, out
    if expected[1] is not None:
        assert proc.returncode == 1
        assert last.startswith(f"FAIL: vLLM {release}") and "own load_weights raised (hotfix not active)" in last
        assert expected[1] in last
    else:
        assert proc.returncode == 0, out
        assert last.startswith("PASS: all 4 ") and "(hotfix not active)" in last
        rows = _rows(out)
        assert list(rows) == PARAMS and all(" OK == " in r for r in rows.values()), rows
        assert "language model left out (vLLM's mm_encoder_only: built on meta, 27 of its tensors not read)" in out


def test_verify_sharded_hub_id_with_bundle(setups, hub_cache, expected):
    """A hub id resolved offline from the huggingface_hub cache, a sharded checkpoint, the bundle on PYTHONPATH."""
    proc = setups.run("bundle", ["verify", "--model", HUB_ID, "--fixes"], HF_HUB_CACHE=str(hub_cache),
                      HF_HUB_OFFLINE="1")
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    assert f"{HUB_ID} (huggingface_hub cache: {hub_cache}" in out
    assert "3 safetensors files (sharded)" in out
    assert "language model left out (vLLM's mm_encoder_only: built on meta, 27 of its tensors not read)" in out
    assert "hotfix      active (mode auto, activated by sitecustomize)" in out
    # --fixes: the line counts, a table under it gives each fix's result
    assert (re.search(r"^  qkv_loader +PATCHED ", out, re.M) is not None) is (expected[0] == "broken"), out
    rows = _rows(out)
    assert list(rows) == PARAMS
    assert all(" OK == " in rows[p] for p in PARAMS), rows
    assert "OK == cat(q_proj, k_proj, v_proj)" in rows[PARAMS[0]]
    assert "float32" in rows[PARAMS[0]] and "[192, 64]" in rows[PARAMS[0]]
    assert "peak RSS" in out and "time " in out
    assert out.strip().splitlines()[-1].startswith("PASS: all 4 vit_merger qkv_proj/out_proj tensors equal")


def test_verify_corrupted_qkv_fails_and_names_it(setups, corrupted):
    proc = setups.run("pip", ["verify", "--model", str(corrupted)])
    out = proc.stdout
    assert proc.returncode == 1, out
    last = out.strip().splitlines()[-1]
    assert last.startswith("FAIL: 1 of 4 vit_merger tensors do not match the checkpoint (hotfix active)")
    assert f"{PREFIX}k_proj.weight holds 5 non-finite value(s)" in last
    rows = _rows(out)
    assert rows[PARAMS[0]].split()[-1] != "OK" and "k_proj.weight" in rows[PARAMS[0]]
    assert all(" OK == " in rows[p] for p in PARAMS[1:]), rows
    assert "Traceback" not in out + proc.stderr


# --------------------------------------------------------------------------------------------------------------------
# verify: bad input -- one line on stderr, exit 2, vLLM never imported
# --------------------------------------------------------------------------------------------------------------------


def _bad_input(setups, args: list[str], **env: str) -> str:
    proc = setups.run("none", ["verify", *args], **env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert proc.seconds < 20, f"bad input took {proc.seconds:.1f} s: vLLM imported?"
    return lines[0]


def test_verify_not_a_checkpoint(setups, tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    line = _bad_input(setups, ["--model", str(tmp_path)])
    assert f"{tmp_path} is not a model checkpoint: it has no config.json" in line


def test_verify_other_model(setups, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    line = _bad_input(setups, ["--model", str(tmp_path)])
    assert "is not a MiniCPM-V 4.6-family checkpoint: config.json has model_type 'llama'" in line


def test_verify_wrong_shape(setups, tmp_path):
    from safetensors.torch import save_file

    ckpt = _copy_without_weights(tmp_path / "ckpt")
    tensors = _tiny_tensors()
    tensors[PREFIX + "v_proj.bias"] = tensors[PREFIX + "v_proj.bias"][:-1].clone()
    save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    line = _bad_input(setups, ["--model", str(ckpt)])
    assert f"checkpoint tensor {PREFIX}v_proj.bias has shape [63], expected [64]" in line


def test_verify_missing_shard_and_truncated_file(setups, hub_cache, tmp_path):
    snap = next((hub_cache / ("models--" + HUB_ID.replace("/", "--")) / "snapshots").iterdir())
    ckpt = tmp_path / "ckpt"
    shutil.copytree(snap, ckpt)
    (ckpt / "model-00002-of-00003.safetensors").unlink()
    line = _bad_input(setups, ["--model", str(ckpt)])
    assert "shard model-00002-of-00003.safetensors listed in model.safetensors.index.json is missing" in line
    shutil.copy(snap / "model-00002-of-00003.safetensors", ckpt)
    f = ckpt / "model-00003-of-00003.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    line = _bad_input(setups, ["--model", str(ckpt)])
    assert f"{f.name} (" in line and "truncated or corrupt safetensors file" in line


def test_verify_hub_id_offline_not_cached(setups, tmp_path):
    line = _bad_input(setups, ["--model", "nobody/not-cached-anywhere"], HF_HUB_CACHE=str(tmp_path),
                      HF_HUB_OFFLINE="1")
    assert "nobody/not-cached-anywhere is not in the local Hugging Face cache" in line and "offline" in line


def test_verify_debug_shows_traceback(setups, tmp_path):
    proc = setups.run("none", ["verify", "--model", str(tmp_path), "--debug"])
    assert proc.returncode == 2 and "Traceback" in proc.stderr and "BadInput" in proc.stderr


# --------------------------------------------------------------------------------------------------------------------
# verify: the comparison itself (in this process, on plain tensors)
# --------------------------------------------------------------------------------------------------------------------


def test_compare_names_the_rows_that_differ():
    import torch

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, 3, generator=g) for _ in range(3))
    parts = [(f"{PREFIX}{p}_proj.weight", t) for p, t in zip("qkv", (q, k, v))]
    ok, result = verify._compare(torch.cat([q, k, v]), parts)
    assert ok and result == "OK == cat(q_proj, k_proj, v_proj)"
    ok, result = verify._compare(torch.cat([q, v, k]), parts)  # k and v swapped, as a mis-routing loader would
    assert not ok
    assert f"rows 4:8 != checkpoint {PREFIX}k_proj.weight" in result
    assert f"rows 8:12 != checkpoint {PREFIX}v_proj.weight" in result and "q_proj" not in result
    ok, result = verify._compare(torch.cat([q, k]), parts)
    assert not ok and result.startswith("MISMATCH shape [8, 3] != [12, 3]")
    ok, result = verify._compare(torch.cat([q, k, v]).to(torch.bfloat16), parts)  # vLLM casts on copy
    assert ok


def test_inspect_sharded_checkpoint(hub_cache):
    snap = next((hub_cache / ("models--" + HUB_ID.replace("/", "--")) / "snapshots").iterdir())
    ckpt = verify.inspect_checkpoint(snap, "test")
    assert ckpt.sharded and [f.name for f in ckpt.files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert ckpt.attn_prefix == PREFIX and len(ckpt.tensors) == len(_tiny_tensors())
    assert ckpt.tensors[PREFIX + "q_proj.weight"].file.name == "model-00001-of-00003.safetensors"


# --------------------------------------------------------------------------------------------------------------------
# doctor: the judgement on facts that need no extra vLLM process
# --------------------------------------------------------------------------------------------------------------------


def test_vllm_plugins_allowlist_is_read_as_vllm_reads_it(monkeypatch):
    """vLLM splits VLLM_PLUGINS on ',' without stripping: ' minicpm_hotfix' does not name the plugin."""
    monkeypatch.setenv("VLLM_PLUGINS", "other, minicpm_hotfix")
    pl = doctor.activation_facts()["vllm_plugins"]
    assert pl["allowlist"] == ["other", " minicpm_hotfix"] and pl["allows_ours"] is False and pl["near_miss"] is True
    monkeypatch.setenv("VLLM_PLUGINS", "other,minicpm_hotfix")
    assert doctor.activation_facts()["vllm_plugins"]["allows_ours"] is True
    monkeypatch.setenv("VLLM_PLUGINS", "")
    pl = doctor.activation_facts()["vllm_plugins"]
    assert pl["allowlist"] == [""] and pl["allows_ours"] is False
    monkeypatch.delenv("VLLM_PLUGINS")
    assert doctor.activation_facts()["vllm_plugins"]["allows_ours"] is True


def _report(*, entry_point: bool, pth: bool, allow: str | None, mode: str = "auto", hook: bool = False) -> dict:
    fixes = {"qkv_loader": {"stock": "broken", "stock_reason": "k_proj", "now": "correct" if hook else "broken",
                            "now_reason": "", "applied": hook, "needed": True, "ok": hook, "hook_error": None,
                            "why": None}}
    allow_list = None if allow is None else allow.split(",")
    return {
        "python": {"flags": [], "executable": sys.executable},
        "vllm": {"installed": True, "version": "0.28.0"},
        "mode": {"value": mode},
        "activation": {
            "entry_point": {"registered": entry_point, "entries": []},
            "vllm_plugins": {"VLLM_PLUGINS": allow, "allowlist": allow_list,
                             "allows_ours": allow_list is None or "minicpm_hotfix" in allow_list, "near_miss": False},
            "pth": {"files": ["x/vllm-minicpm-hotfix.pth"] if pth else [], "active": pth},
            "sitecustomize": {"ours": None, "shadowed_by": None, "pythonpath_ignored": False, "found": []},
            "bundles": [],
        },
        "child": {"vllm_version": "0.28.0", "module": True, "steps": {"model module": {"hook_installed": hook}},
                  "status": None},
        "fixes": fixes,
    }


def test_judge_says_what_to_do():
    ok, line = doctor.judge(_report(entry_point=True, pth=False, allow="other"))
    assert not ok and "VLLM_PLUGINS='other' leaves out the 'minicpm_hotfix' plugin" in line
    assert "set VLLM_PLUGINS=other,minicpm_hotfix" in line
    ok, line = doctor.judge(_report(entry_point=False, pth=False, allow=None))
    assert not ok and "not installed in this environment" in line
    ok, line = doctor.judge(_report(entry_point=True, pth=True, allow=None, mode="off"))
    assert not ok and "VLLM_MINICPM_HOTFIX=off" in line
    ok, line = doctor.judge(_report(entry_point=True, pth=True, allow="other", hook=True))
    assert ok and line.startswith("OK: a vLLM 0.28.0 started from this environment loads MiniCPM-V 4.6 correctly")
    report = _report(entry_point=False, pth=False, allow=None)
    report["vllm"] = {"installed": False, "version": None}
    ok, line = doctor.judge(report)
    assert not ok and line.startswith("FAIL: vLLM is not installed for ")
