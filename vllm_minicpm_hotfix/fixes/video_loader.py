"""Let a ``video_url`` request reach vLLM's video loader when transformers maps the model type to a dict.

What breaks
-----------
To pick a video loader backend, vLLM's chat front end asks for the checkpoint's video processor class name
(``ChatParser``'s tracker -> ``get_video_processor_cls_name(model_config)`` -> the ``lru_cache``
``_cached_get_video_processor_cls_name`` over ``get_video_processor_cls_name_from_config``, in
``vllm/transformers_utils/processor.py``) and hands it to ``get_video_loader_backend_for_processor``
(``vllm/multimodal/video.py``), a ``dict.get`` on the loader registry. A checkpoint whose ``preprocessor_config.json``
names no ``video_processor_type`` (the 4.6 checkpoints ``save_pretrained`` writes have none) falls back to
``transformers.models.auto.video_processing_auto.VIDEO_PROCESSOR_MAPPING_NAMES[config.model_type]`` (vLLM
0.24-0.31), which transformers >= 5.19 maps to a dict (``{"torchvision": "MiniCPMV4_6VideoProcessor"}``), not a
class name. The dict then is the registry key: every chat request with a ``video_url`` fails in the API server with
``TypeError: unhashable type: 'dict'`` (HTTP 400) before any frame is decoded, unless the operator passes
``--media-io-kwargs '{"video": {"video_backend": "opencv"}}'``, which skips the look-up. vLLM 0.32 reads the
``"torchvision"`` entry of such a dict (the same function there).

What the fix does
-----------------
It wraps ``vllm.transformers_utils.processor._cached_get_video_processor_cls_name(processor_name: str, revision:
str | None = "main") -> str | None`` (the module global ``get_video_processor_cls_name`` calls): where vLLM's answer
is a dict and the checkpoint's ``config.json`` ``model_type`` is a family member the fix declares
(:data:`MODEL_TYPES`, :data:`MODELS`), it returns the dict's ``"torchvision"`` entry (a ``str``, or None), as vLLM
0.32's ``get_video_processor_cls_name_from_config`` does. No registered loader names ``MiniCPMV4_6VideoProcessor``,
so the backend stays vLLM's default (``VLLM_VIDEO_LOADER_BACKEND``, OpenCV), exactly as with ``--media-io-kwargs``
naming it or on 0.32. Any other answer, and any other model's, is vLLM's own.

The decision
------------
:func:`probe` writes a stand-in checkpoint directory (``config.json`` with ``model_type`` ``minicpmv4_6``, an empty
``preprocessor_config.json``: no ``video_processor_type``, no hub look-up), asks the installed
``_cached_get_video_processor_cls_name`` for its video processor name as vLLM's chat front end does, and hands that
to the installed ``get_video_loader_backend_for_processor``: ``broken`` if that raises (the ``TypeError`` above),
``correct`` if it answers, ``undetermined`` if the stand-in cannot be written or the name look-up itself fails;
``correct`` and not applicable where vLLM chooses no video loader by processor name at all (0.22: no
``_cached_get_video_processor_cls_name`` or no ``get_video_loader_backend_for_processor``).

Upstream
--------
none known (0.32 reads the ``"torchvision"`` entry of transformers' mapping itself).

Remove when
-----------
its probe sees stock ``get_video_loader_backend_for_processor`` answer, without a ``TypeError``, for the name
``_cached_get_video_processor_cls_name`` gives a checkpoint without ``video_processor_type``, on every release the
hotfix supports: once 0.24-0.31 are no longer supported.

"""

from __future__ import annotations

import functools
import importlib
import json
import shutil
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

from ..decision import State, Verdict
from ._base import V46, V47, wrap

NAME = "video_loader"
LABEL = "video loader look-up without a video_processor_type (video_url requests)"
PROCESSOR_MODULE = "vllm.transformers_utils.processor"
VIDEO_MODULE = "vllm.multimodal.video"
CACHED = "_cached_get_video_processor_cls_name"
BACKEND = "get_video_loader_backend_for_processor"
#: 4.7 on 0.24-0.30 is the hotfix's backport, whose video_url requests take the same look-up; 0.32+ read the dict
#: themselves.
MODELS = (V46, V47)
#: ``config.json`` ``model_type`` -> family member.
MODEL_TYPES = {"minicpmv4_6": V46, "minicpmv4_7": V47}
#: The entry of transformers' dict vLLM 0.32 reads.
DICT_KEY = "torchvision"


@functools.lru_cache(maxsize=64)
def model_type_of(processor_name: str, revision: str | None) -> str | None:
    """The ``model_type`` of the checkpoint's ``config.json`` read as vLLM reads it (``get_hf_file_to_dict``), or
    None when it cannot be read. Read once per checkpoint, as vLLM's own look-up is cached."""
    try:
        from vllm.transformers_utils.repo_utils import get_hf_file_to_dict
        from vllm.transformers_utils.utils import convert_model_repo_to_path

        config = get_hf_file_to_dict("config.json", convert_model_repo_to_path(processor_name), revision=revision)
    except Exception:  # noqa: BLE001 - vLLM's own answer then
        return None
    return config.get("model_type") if isinstance(config, dict) else None


def checkpoint_member(_: Any, args: tuple, kwargs: dict) -> str | None:
    """The family member the checkpoint of a ``_cached_get_video_processor_cls_name(processor_name, revision="main")``
    call is (the class policy's subject), or None for other models."""
    processor_name = kwargs.get("processor_name", args[0] if args else None)
    revision = kwargs.get("revision", args[1] if len(args) > 1 else "main")
    return MODEL_TYPES.get(model_type_of(str(processor_name), revision))


def cached_video_processor_name(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Around ``_cached_get_video_processor_cls_name(processor_name, revision="main") -> str | None`` (see the module
    docstring): the dict's ``"torchvision"`` entry where vLLM's answer is a dict."""
    name = wrapped(*args, **kwargs)
    return name.get(DICT_KEY) if isinstance(name, dict) else name


def _targets() -> tuple[ModuleType, Any, Any] | None:
    try:
        processor = importlib.import_module(PROCESSOR_MODULE)
        backend = getattr(importlib.import_module(VIDEO_MODULE), BACKEND)
    except Exception:  # noqa: BLE001
        return None
    cached = getattr(processor, CACHED, None)
    if not callable(cached) or not callable(backend):
        return None
    return processor, cached, backend


def _if_chosen_by_name(old: Any, _: Any) -> Any:
    """:data:`PATCHES`' value; ``RuntimeError`` (nothing set) where this vLLM chooses no video loader by processor
    name (:func:`_targets`)."""
    if _targets() is None:
        raise RuntimeError(f"{PROCESSOR_MODULE}.{CACHED} or {VIDEO_MODULE}.{BACKEND} is not there")
    return wrap(cached_video_processor_name, model=checkpoint_member)


#: vLLM's ``lru_cache``'s ``cache_info`` / ``cache_clear`` stay reachable on the wrapped function (the framework
#: carries them over).
PATCHES = {f"{PROCESSOR_MODULE}:{CACHED}": _if_chosen_by_name}


def probe(module: ModuleType) -> Verdict:
    """Does vLLM's video loader look-up answer for a 4.6 checkpoint that names no ``video_processor_type``? Never
    raises; changes nothing (the stand-in directory is removed; its entry stays in vLLM's ``lru_cache``)."""
    found = _targets()
    if found is None:
        return Verdict(State.CORRECT, f"vLLM chooses no video loader by processor name here (no "
                                      f"{PROCESSOR_MODULE}.{CACHED} or {VIDEO_MODULE}.{BACKEND})", applicable=False)
    _, cached, backend = found
    try:
        tmp = Path(tempfile.mkdtemp(prefix="vmh-video-loader-"))
    except OSError as exc:
        return Verdict(State.UNDETERMINED, f"no stand-in checkpoint directory: {exc}")
    try:
        (tmp / "config.json").write_text(json.dumps({"model_type": "minicpmv4_6"}))
        (tmp / "preprocessor_config.json").write_text("{}")
        try:
            name = cached(str(tmp), revision="main")
        except Exception as exc:  # noqa: BLE001
            return Verdict(State.UNDETERMINED, f"{CACHED} failed on a stand-in 4.6 checkpoint: "
                                               f"{type(exc).__name__}: {exc}")
        try:
            chosen = backend(name)
        except Exception as exc:  # noqa: BLE001
            return Verdict(State.BROKEN, f"vLLM takes the video processor name of a 4.6 checkpoint without a "
                                         f"video_processor_type to be {name!r}; {BACKEND} then raises "
                                         f"{type(exc).__name__}: {exc} (every video_url request fails)")
        return Verdict(State.CORRECT, f"video processor name {name!r} -> video loader backend {chosen!r} "
                                      f"(vLLM's default where None)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
