"""Test-only start-up code for an e2e server with only the image-processor fix (``processor_downsample_mode``)
active: on a server's PYTHONPATH (no package installed), every process of the server appends the repository to
``sys.path`` and registers a post-import hook that applies just that fix and logs the summary. The product has no
per-fix switch (on purpose)."""

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[3]))
import wrapt  # noqa: E402


def _processor_fix_only(module):
    from vllm_minicpm_hotfix.fixes import _base, processor_downsample_mode
    _base.run(processor_downsample_mode, module)
    from vllm_minicpm_hotfix import record
    from vllm_minicpm_hotfix.fixes import names
    record.log_summary(record.current(), names())


wrapt.register_post_import_hook(_processor_fix_only, 'vllm.model_executor.models.minicpmv4_6')
