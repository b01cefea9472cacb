"""Backport: MiniCPM-OCR (``MiniCPMOcrForConditionalGeneration``) on vLLM releases that lack it.

What is missing
---------------
Only vLLM 0.33+ registers ``MiniCPMOcrForConditionalGeneration`` (``vllm/model_executor/models/minicpm_ocr.py``), and
0.33 requires transformers ``<5.21``, which has no ``minicpm_ocr``. transformers from 5.21.0 reads an OCR checkpoint
(``MiniCPMOcrConfig``, ``MiniCPMOcrProcessor``), and vLLM 0.22-0.30 install such a one (5.24), but their registry has no such
architecture: ``LLM(model=<an OCR checkpoint>)`` and ``vllm serve`` stop at start-up (``Model architectures
['MiniCPMOcrForConditionalGeneration'] are not supported for now``).

What the backport does
----------------------
:func:`register` registers the architecture through vLLM's public model registry, lazily:
``ModelRegistry.register_model(ARCH, "vllm_minicpm_hotfix.backports.models.minicpm_ocr:MiniCPMOcrForConditionalGeneration")``.
The classes (:mod:`.models.minicpm_ocr`) subclass the installed vLLM's three 4.6 classes and add OCR's differences
(read from transformers' ``minicpm_ocr``): every vision layer kept, the ``"4x"`` default, the patch grid aligned to
``patch_size * 2`` in ``"4x"``, and the small-image upsize, which transformers may decide from the pixels: each
image's placeholder is laid out from the crops the image processor returned (``target_sizes``).

The decision
------------
:func:`probe` reads what is installed, never a version string: ``missing`` (register) where vLLM's
``ModelRegistry`` has no ``MiniCPMOcrForConditionalGeneration``, has the 4.6 model, and transformers has
``MiniCPMOcrConfig``; ``correct`` and not applicable where the registry has the architecture (vLLM 0.33's own, or
another plugin's: left alone, under ``force`` too); ``unrecognised`` where the 4.6 model or transformers' OCR config
is not there (0.32 and 0.33 with the transformers they require). ``VLLM_MINICPM_HOTFIX=off`` registers nothing
(:func:`vllm_minicpm_hotfix.backports.run`).

The backport interface (:mod:`vllm_minicpm_hotfix.backports`): ``NAME``, ``LABEL``, ``ARCH``, ``MEMBER``,
:func:`probe`, :func:`register`, :func:`unregister`. Nothing here imports vLLM, torch or transformers at import time.

Upstream
--------
none known (vLLM 0.33 has its own ``minicpm_ocr.py``).

Remove when
-----------
its probe answers ``correct`` (vLLM's own ``MiniCPMOcrForConditionalGeneration`` in the registry) on every release the
hotfix supports: once 0.22-0.32 are no longer supported.
"""

from __future__ import annotations

from ..decision import State, Verdict  # noqa: F401 - the probe's vocabulary (tests patch with it)
from ._lazy import LazyBackport, bind

NAME, MEMBER = "minicpm_ocr", "MiniCPM-OCR"
LABEL = "MiniCPM-OCR model (MiniCPMOcrForConditionalGeneration) on vLLM releases without it"
ARCH = "MiniCPMOcrForConditionalGeneration"
#: The model module vLLM's registry imports lazily (``fixes._base.FAMILY`` lists it), and transformers' config class
#: (and ``model_type``) an OCR checkpoint's ``config.json`` needs.
MODEL_MODULE = "vllm_minicpm_hotfix.backports.models.minicpm_ocr"
CONFIG_CLASS, MODEL_TYPE = "MiniCPMOcrConfig", "minicpm_ocr"

#: ``MODEL``, ``probe``, ``register``, ``unregister``, ``registered``, ``is_ours``: :func:`._lazy.bind`.
bind(globals(), LazyBackport(ARCH, MODEL_MODULE, CONFIG_CLASS, MODEL_TYPE, "MiniCPM-OCR"))
