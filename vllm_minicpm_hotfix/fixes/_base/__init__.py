"""The framework every fix shares. A fix is one module of this package's parent holding only its behaviour::

    NAME = "video_budget"                  # status()["fixes"] key, doctor row, module and test file name
    LABEL = "video encoder budget ..."     # what it fixes, for the log lines
    MODELS = (V46, V47)                    # the family members it acts for (family.V46, ...)
    AFTER = ("qkv_loader",)                # optional: fixes it must come after in the registry
    PATCHES = {f"{INFO_CLASS}.get_num_frames_with_most_features": wrap(get_num_frames)}

    def get_num_frames(wrapped, instance, args, kwargs): ...   # the behaviour, as a wrapt wrapper receives it
    def probe(module) -> Verdict: ...      # runs the installed code on stand-ins; never raises; no version strings

The parts, each read on its own:

* :mod:`.family` -- the members (``FAMILY``), the vLLM class names the fixes patch, and the class policy
  (:func:`~.family.covers`): declared members act, a subclass no member owns is reported once and handed to vLLM's
  code, an undeclared member's class is left to vLLM's code.
* :mod:`.wrappers` -- the three kinds of ``PATCHES`` line (:func:`~.wrappers.wrap`, :func:`~.wrappers.replace`,
  :func:`~.wrappers.attribute`) and the value built from each: wrapt's ``FunctionWrapper`` with one wrapper
  function (the class policy, the arguments by name, refusals).
* :mod:`.patching` -- a fix's table set as one transaction (:func:`~.patching.apply_patches`), marked and recorded;
  targets set when vLLM imports their module (:func:`~.patching.on_import`); chains of two fixes on one attribute;
  revert.
* :mod:`.deciding` -- probe per member, decide with the mode, apply, record, one INFO line.
* :mod:`.deferred` -- probes that wait for the first use of their code path (``DEFER_AT``).
* :mod:`.running` -- what the post-import hook does for one fix.
* :mod:`.memo` -- :class:`~.memo.WeakMemo`, the bounded memo behaviours keep per-request values in.

The registry (:data:`vllm_minicpm_hotfix.fixes.REGISTRY`) calls :func:`~.patching.complete` on every fix, which
derives ``SETS`` (the targets) and ``apply(module)``. Two rules for ``probe``: it judges by running the installed code
on stand-ins, never by a version string; and re-run where the fix *is* applied it must answer ``CORRECT``. Importing
this package imports nothing of vLLM, torch, transformers or wrapt.
"""

from __future__ import annotations

from . import deferred, patching
from .deciding import decide_and_apply, unknown_subclasses
from .family import (
    ATTN_CLASS, DEFAULT_MODELS, FAMILY, INFO_CLASS, MODEL_CLASS, PROCESSOR_CLASS, V46, V47, V47_MODEL_CLASS, VOCR,
    V47_MODULE, _ACTIVE, _import_member, base_named, class_name, covers, imported_member, initialising, mark_complete, member_modules, member_reason, member_view,
    model_of, models_of, note_unknown,
)
from .patching import (
    MARKER_ATTR, _MISSING, OnImport, apply_patches, complete, has_set, is_patched, on_import, patched_by, resolve,
    revert, revert_fix, set_attributes, shared_targets, wraps_of,
)
from .deferred import PROCESSOR_PATH
from .memo import WeakMemo
from .running import run
from .wrappers import (
    BEHAVIOUR_ATTR, EVERY_CALL, SELF, Call, Patch, Refusal, Signature, arguments, attribute, replace, wrap,
)

__all__ = [
    "ATTN_CLASS", "BEHAVIOUR_ATTR", "Call", "DEFAULT_MODELS", "EVERY_CALL", "FAMILY", "INFO_CLASS",
    "MARKER_ATTR", "MODEL_CLASS", "OnImport", "PROCESSOR_PATH", "PROCESSOR_CLASS", "Patch", "Refusal", "SELF", "Signature", "V46", "V47",
    "V47_MODEL_CLASS", "V47_MODULE", "VOCR", "WeakMemo", "apply_patches", "arguments", "attribute", "base_named", "class_name", "complete", "covers", "decide_and_apply", "deferred", "has_set",
    "imported_member", "initialising", "is_patched", "mark_complete", "member_modules", "member_reason", "member_view",
    "model_of", "models_of", "note_unknown", "on_import", "patched_by", "replace", "resolve", "revert", "revert_fix",
    "run", "set_attributes", "shared_targets", "unknown_subclasses", "wrap", "wraps_of",
]
