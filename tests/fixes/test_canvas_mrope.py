"""canvas_mrope: MiniCPM-V 4.7's canvas M-RoPE positions for a checkpoint whose config transformers wrote.

* The probe's reference (``canvas_mrope.reference_positions``, plain torch) equals transformers' own
  ``MiniCPMV4_7Model.get_rope_index`` on four slice layouts: the probe judges vLLM against transformers.
* Stock vLLM 0.32-0.33 leaves the canvas off for such a config (sequential positions) and the probe says broken on
  4.7's classes; with the fix the canvas is on, the probe says correct, and the positions of a real prompt equal
  transformers' (tests/registry/test_family.py::test_v47_mrope_positions_equal_transformers, on the tiny 4.7
  checkpoint and transformers' own processor).
* A config that states its mode (``uses_mrope_canvas: false``) keeps vLLM's reading of it; a 4.6 model class has no
  canvas (nothing to correct, not applicable).

Placed where vLLM has 4.7's own classes (0.32.0, 0.33.0): no engine, < 10 s after ``import vllm``.
"""

from __future__ import annotations

import pytest
from support.hotfix import hotfix
from support.prompt import V47_ENVS

from vllm_minicpm_hotfix.decision import State
from vllm_minicpm_hotfix.fixes import _base, canvas_mrope

pytestmark = pytest.mark.placed(*V47_ENVS)


@pytest.fixture(scope="module")
def v47_view(m46):
    return _base.member_modules(m46)["MiniCPM-V 4.7"]


@pytest.mark.parametrize("rows, cols", [(0, 0), (1, 2), (2, 2), (2, 3)])
def test_reference_is_transformers_own(rows, cols):
    import torch
    from torch import nn
    from transformers import MiniCPMV4_7Config
    from transformers.models.minicpmv4_7.modeling_minicpmv4_7 import MiniCPMV4_7Model

    model = MiniCPMV4_7Model.__new__(MiniCPMV4_7Model)
    nn.Module.__init__(model)
    model.config = MiniCPMV4_7Config(image_token_id=canvas_mrope.PAD, **canvas_mrope.PROBE_IDS)
    ids, sizes = canvas_mrope.probe_prompt(rows, cols)
    t = torch.tensor([ids])
    want, _ = model.get_rope_index(t, mm_token_type_ids=(t == canvas_mrope.PAD).int(), target_sizes=torch.tensor(sizes))
    assert torch.equal(canvas_mrope.reference_positions(ids, sizes), want[:, 0])


def test_stock_is_sequential_and_the_fix_lays_out_the_canvas(m46, v47_view):
    cls = getattr(v47_view, _base.MODEL_CLASS)
    ids, sizes = canvas_mrope.probe_prompt(2, 2)
    stock, _ = canvas_mrope.installed_positions(cls, ids, sizes)
    assert stock.tolist() == [list(range(len(ids)))] * 3  # sequential: the defect
    assert canvas_mrope.probe(v47_view).state is State.BROKEN
    with hotfix(m46, "auto", fixes=("canvas_mrope",)) as status:
        assert status.applied and status.models["MiniCPM-V 4.7"]["applied"]
        got, _ = canvas_mrope.installed_positions(cls, ids, sizes)
        assert canvas_mrope.probe(v47_view).state is State.CORRECT
    assert got.tolist() == canvas_mrope.reference_positions(ids, sizes).tolist()


def test_a_stated_mode_is_vllms_and_46_has_no_canvas(m46, v47_view):
    from torch import nn
    from transformers import MiniCPMV4_7Config

    cls = getattr(v47_view, _base.MODEL_CLASS)
    with hotfix(m46, "force", fixes=("canvas_mrope",)):
        model = cls.__new__(cls)
        nn.Module.__init__(model)
        model.config = MiniCPMV4_7Config(image_token_id=canvas_mrope.PAD, uses_mrope_canvas=False,
                                         **canvas_mrope.PROBE_IDS)
        model._init_canvas_mrope(None)
        assert model._uses_canvas_mrope is False
    verdict = canvas_mrope.probe(m46)
    assert verdict.state is State.CORRECT and not verdict.applicable, verdict
