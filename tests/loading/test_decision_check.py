"""The q/k/v decision's own check: can the probe tell a vLLM that loads *without raising but wrongly* from one that
loads correctly? Every release in the run (cheap: no model is built, only the probe's bare stand-ins).

Stand-ins built from the real installed classes: a copy of the real ``vllm.model_executor.models.minicpmv4_6``
namespace (the real ``MiniCPMV4_6ViTWindowAttentionSelfAttn``, ``QKVParallelLinear``, mapper, helpers) in which
``MiniCPMV4_6ForConditionalGeneration`` is a subclass of the real class whose top-level ``load_weights`` is replaced.
Two families of replacements:

* **hand-written** -- the stacked-parameter loop of vLLM 0.22-0.24 (``MiniCPMV4_6ViTWindowAttentionSelfAttn.
  load_weights`` there), at the top level, calling each parameter's real ``weight_loader(param, tensor, shard_id)``:
  (a) k and v shard ids swapped, (b) q's values loaded under shard ``"k"``, (c) the biases dropped, (d) correct.
  Never raises on any release, so the verdict must come from *where the tensors land*, not from an exception.
* **the release's own** top-level ``load_weights``, fed a tampered checkpoint stream: (a) the k/v names swapped,
  (b) q's tensor under the ``k_proj`` names, (c) the biases dropped, (d) untouched. Where the release's own loading
  is correct (0.22-0.24, 0.30+) the first three are real vLLM code loading wrongly without an error.

The probe must say broken, broken, broken, correct for the hand-written family on every release; for the release's
own family broken, broken, broken and the release's verdict from tests/support/expected.py ``VERDICTS``.
"""

from __future__ import annotations

import types

import pytest

MODEL = "MiniCPMV4_6ForConditionalGeneration"
VIT = "model.vision_tower.vit_merger.self_attn."
SHARDS = {"q_proj": "q", "k_proj": "k", "v_proj": "v"}


def probe(module):
    """The q/k/v fix's probe, as the post-import hook calls it."""
    from vllm_minicpm_hotfix.fixes import qkv_loader

    return qkv_loader.probe(module)


def stand_in_module(m46, load_weights) -> types.ModuleType:
    """A copy of the real model module whose model class is a subclass of the real one with ``load_weights``."""
    real = getattr(m46, MODEL)
    module = types.ModuleType(m46.__name__)
    module.__dict__.update(vars(m46))
    setattr(module, MODEL, type(MODEL, (real,), {"load_weights": load_weights, "__module__": m46.__name__}))
    return module


# --------------------------------------------------------------------------------------------------------------------
# Hand-written top-level loaders (vLLM 0.22-0.24's stacked-parameter loop, lifted to the top level)
# --------------------------------------------------------------------------------------------------------------------


def hand_written(*, shard_of=SHARDS, values_from=None, skip_bias=False):
    """A top-level ``load_weights`` that routes ``...vit_merger.self_attn.{q,k,v}_proj.S`` to ``qkv_proj.S`` with
    ``shard_of[...]`` as the shard id through the parameter's real weight loader; ``values_from`` maps a checkpoint
    module to the module whose tensor it loads instead; ``skip_bias`` ignores every ``.bias``."""
    values_from = values_from or {}

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        held = dict(weights)
        loaded = set()
        for name, tensor in held.items():
            if skip_bias and name.endswith(".bias"):
                continue
            short = name[len("model.vision_tower."):] if name.startswith("model.vision_tower.") else name
            head, _, suffix = short.rpartition(".")
            parent, _, module = head.rpartition(".")
            if module in SHARDS:
                src = values_from.get(module)
                if src is not None:
                    tensor = held[name.replace(f".{module}.", f".{src}.")]
                target = f"{parent}.qkv_proj.{suffix}"
                param = params[target]
                param.weight_loader(param, tensor, shard_of[module])
            else:
                target = short
                param = params[target]
                param.weight_loader(param, tensor)
            loaded.add(target)
        return loaded

    return load_weights


HAND_WRITTEN = {
    "a-k-v-shard-ids-swapped": (hand_written(shard_of={"q_proj": "q", "k_proj": "v", "v_proj": "k"}), "broken"),
    "b-q-values-under-shard-k": (hand_written(values_from={"k_proj": "q_proj"}), "broken"),
    "c-bias-dropped": (hand_written(skip_bias=True), "broken"),
    "d-correct": (hand_written(), "correct"),
}


@pytest.mark.parametrize("case", list(HAND_WRITTEN))
def test_hand_written_loaders(m46, case):
    load_weights, want = HAND_WRITTEN[case]
    verdict = probe(stand_in_module(m46, load_weights))
    print(f"\n{case}: {verdict.state.value}: {verdict.reason}")
    assert verdict.state.value == want, verdict.reason
    if want == "broken":
        assert "routes the split q/k/v wrongly" in verdict.reason  # from where the tensors landed, not an exception


# --------------------------------------------------------------------------------------------------------------------
# The release's own top-level load_weights on a tampered checkpoint stream
# --------------------------------------------------------------------------------------------------------------------


def tampered(m46, edit):
    """The real ``load_weights`` of this release, fed ``edit(list of (name, tensor))``."""
    real = getattr(m46, MODEL).load_weights

    def load_weights(self, weights):
        return real(self, iter(edit(list(weights))))

    return load_weights


def _swap_kv(items):
    swap = {"k_proj": "v_proj", "v_proj": "k_proj"}
    out = []
    for name, t in items:
        for old, new in swap.items():
            if f".{old}." in name:
                name = name.replace(f".{old}.", f".{new}.")
                break
        out.append((name, t))
    return sorted(out, key=lambda x: x[0])


def _q_under_k(items):
    d = dict(items)
    return [(n, d[n.replace(".k_proj.", ".q_proj.")] if ".k_proj." in n else t) for n, t in items]


def _no_bias(items):
    return [(n, t) for n, t in items if not n.endswith(".bias")]


OWN = {
    "a-k-v-names-swapped": (_swap_kv, "broken"),
    "b-q-values-under-k-names": (_q_under_k, "broken"),
    "c-bias-dropped": (_no_bias, "broken"),
    "d-untouched": (lambda items: items, None),  # None: this release's verdict in tests/support/expected.py
}


@pytest.mark.parametrize("case", list(OWN))
def test_release_own_loader_on_tampered_stream(m46, expected, case):
    edit, want = OWN[case]
    want = want or expected[0]
    verdict = probe(stand_in_module(m46, tampered(m46, edit)))
    print(f"\n{case}: {verdict.state.value}: {verdict.reason}")
    assert verdict.state.value == want, verdict.reason
