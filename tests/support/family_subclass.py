"""A MiniCPM-V family member the hotfix does not know: "4.8" classes subclassing vLLM's 4.6 classes, defined in a
module that is not in ``vllm_minicpm_hotfix.fixes._base.FAMILY`` and registered as vLLM registers a model
(``MULTIMODAL_REGISTRY.register_processor`` on the model class, ``ModelRegistry.register_model`` for the
architecture), the way vLLM 0.32 added 4.7. Importing this module imports vLLM's 4.6 model module (and so runs the
hotfix's post-import hook where it is installed)."""

from __future__ import annotations

from vllm import ModelRegistry
from vllm.model_executor.models import minicpmv4_6 as m46
from vllm.multimodal import MULTIMODAL_REGISTRY

ARCH = "MiniCPMV4_8ForConditionalGeneration"


class MiniCPMV4_8ProcessingInfo(m46.MiniCPMV4_6ProcessingInfo):
    pass


class MiniCPMV4_8MultiModalProcessor(m46.MiniCPMV4_6MultiModalProcessor):
    pass


@MULTIMODAL_REGISTRY.register_processor(
    MiniCPMV4_8MultiModalProcessor, info=MiniCPMV4_8ProcessingInfo, dummy_inputs=m46.MiniCPMVDummyInputsBuilder
)
class MiniCPMV4_8ForConditionalGeneration(m46.MiniCPMV4_6ForConditionalGeneration):
    pass


ModelRegistry.register_model(ARCH, f"{__name__}:{ARCH}")

#: vLLM's 4.6 class -> its "4.8" subclass here.
SUBCLASSES = {
    m46.MiniCPMV4_6ProcessingInfo: MiniCPMV4_8ProcessingInfo,
    m46.MiniCPMV4_6MultiModalProcessor: MiniCPMV4_8MultiModalProcessor,
    m46.MiniCPMV4_6ForConditionalGeneration: MiniCPMV4_8ForConditionalGeneration,
}
