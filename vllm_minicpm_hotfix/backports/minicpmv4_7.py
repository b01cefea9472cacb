"""Backport: MiniCPM-V 4.7 (``MiniCPMV4_7ForConditionalGeneration``, dense 1B and MoE 35B-A3B) on vLLM releases that
lack it.

What is missing
---------------
Only vLLM 0.32+ registers ``MiniCPMV4_7ForConditionalGeneration`` (``vllm/model_executor/models/minicpmv4_7.py``).
On 0.22-0.31 ``LLM(model=<a 4.7 checkpoint>)`` and ``vllm serve`` stop at start-up with ``Model architectures
['MiniCPMV4_7ForConditionalGeneration'] are not supported for now``, although those releases have the 4.6 classes
4.7 builds on and transformers (>= 5.19) reads a 4.7 checkpoint (``MiniCPMV4_7Config``, ``MiniCPMV4_7Processor``).

What the backport does
----------------------
:func:`register` registers the architecture through vLLM's public model registry, in the lazy form plugins use:
``ModelRegistry.register_model(ARCH, "vllm_minicpm_hotfix.backports.models.minicpmv4_7:MiniCPMV4_7ForConditionalGeneration")``.
vLLM imports that module only when it resolves a 4.7 checkpoint; its model class registers its multimodal processor
with ``MULTIMODAL_REGISTRY.register_processor`` as vLLM's own models do (:mod:`.models.minicpmv4_7`). Every fix of
this package then acts for 4.7 as it does on 0.32 (``fixes._base.FAMILY`` names the module as MiniCPM-V 4.7).

The decision
------------
:func:`probe` reads what is installed, never a version string: ``missing`` (register) where the installed vLLM's
``ModelRegistry`` has no ``MiniCPMV4_7ForConditionalGeneration`` of its own, has the 4.6 model it builds on, and the
installed transformers has ``MiniCPMV4_7Config``; ``correct`` and not applicable where the registry already has the
architecture ("vLLM's own" on 0.32+, or another plugin's: left alone, under ``force`` too); ``unrecognised`` where the
4.6 model or transformers' 4.7 config is not there. An entry this backport registered is not vLLM's own: the verdict
stays ``missing`` once registered.

The backport interface (:mod:`vllm_minicpm_hotfix.backports`): ``NAME``, ``LABEL``, ``ARCH``, ``MEMBER``,
:func:`probe`, :func:`register`, :func:`unregister`. Nothing here imports vLLM, torch or transformers at import time.

Upstream
--------
none known (vLLM 0.32 has its own ``minicpmv4_7.py``).

Remove when
-----------
its probe answers ``correct`` (vLLM's own ``MiniCPMV4_7ForConditionalGeneration`` in the registry) on every release
the hotfix supports: once 0.22-0.31 are no longer supported.
"""

from __future__ import annotations

from ..decision import State, Verdict  # noqa: F401 - the probe's vocabulary (tests patch with it)
from ._lazy import LazyBackport, bind

NAME = "minicpmv4_7"
LABEL = "MiniCPM-V 4.7 model (MiniCPMV4_7ForConditionalGeneration) on vLLM releases without it"
ARCH = "MiniCPMV4_7ForConditionalGeneration"
MEMBER = "MiniCPM-V 4.7"
#: The backport's model module (the one vLLM's registry imports lazily; ``fixes._base.FAMILY`` lists it).
MODEL_MODULE = "vllm_minicpm_hotfix.backports.models.minicpmv4_7"
#: transformers' config class a 4.7 checkpoint's ``config.json`` needs, and its ``model_type``.
CONFIG_CLASS, MODEL_TYPE = "MiniCPMV4_7Config", "minicpmv4_7"

#: ``MODEL``, ``probe``, ``register``, ``unregister``, ``registered``, ``is_ours``: :func:`._lazy.bind`.
bind(globals(), LazyBackport(ARCH, MODEL_MODULE, CONFIG_CLASS, MODEL_TYPE, "4.7"))
