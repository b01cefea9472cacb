"""A stand-in for a vLLM release that does not exist yet (tests/canary/test_canary.py): the installed vLLM, altered the
way a new release might change it, then the canary's verdict program (scripts/canary_verdicts.py) in this process,
before the hotfix's hook has run. Run with the Python of a vLLM environment, one alteration per argument:

``loader-default-moved``
    ``VideoMediaIO.__init__`` no longer carries the number of frames it samples as a default (``num_frames=None``,
    resolved inside, as a release reading it from a config would): ``video_budget``'s probe cannot read what the
    loader loads, so its verdict is ``undetermined`` and ``auto`` leaves the fix off -- as vLLM 0.34.0's new
    ``get_cached_item`` call made ``placeholder_guard``'s probe ``undetermined``. The loader still samples 32 frames.
``frame-cap-raised``
    ``minicpmv._MAX_FRAMES_PER_VIDEO`` raised from 16 to 32, the frames vLLM's video loader samples: vLLM's own
    ``get_num_frames_with_most_features`` budgets every loaded frame, the upstream fix of what ``video_budget``
    repairs, so that fix is no longer needed.
``import-broken``
    ``import vllm`` raises, as a release whose import fails on this machine would.
"""

import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def loader_default_moved() -> None:
    from vllm.multimodal.media.video import VideoMediaIO

    shipped = VideoMediaIO.__init__

    def __init__(self, image_io, num_frames=None, **kwargs):
        shipped(self, image_io, 32 if num_frames is None else num_frames, **kwargs)

    VideoMediaIO.__init__ = __init__


def frame_cap_raised() -> None:
    from vllm.model_executor.models import minicpmv

    assert minicpmv._MAX_FRAMES_PER_VIDEO == 16, minicpmv._MAX_FRAMES_PER_VIDEO  # the cap this stand-in lifts
    minicpmv._MAX_FRAMES_PER_VIDEO = 32


def import_broken() -> None:
    class Refuse:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name == "vllm":
                raise RuntimeError("stand-in release: vllm does not import here")
            return None

    sys.meta_path.insert(0, Refuse)


ALTERATIONS = {"loader-default-moved": loader_default_moved, "frame-cap-raised": frame_cap_raised,
               "import-broken": import_broken}

for name in sys.argv[1:] or sys.exit(f"usage: {sys.argv[0]} {' '.join(ALTERATIONS)}"):
    ALTERATIONS[name]()
runpy.run_path(str(REPO / "scripts" / "canary_verdicts.py"), run_name="__main__")
