"""The demo's own check (scripts/demo.py ``compare_with_bundled``): the checkpoint transformers writes here has weights
byte-identical to the copy bundled in the package, and the check fails (the demo exits 1) when they are not.

The whole demo (an engine start, ~2-3 minutes) is not run here; it is run by hand and its output quoted in
docs/demo.md.

Placed on ``FULL_ENVS`` (0.28.0 is the demo's release): the weights depend on torch and transformers, and were also
checked by hand to be identical with 0.26.0 (torch 2.11) and 0.33.0 (transformers 5.20.2); ~10 s of CPU per
environment to place it everywhere.
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
