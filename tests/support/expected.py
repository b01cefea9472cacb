"""What each environment of the run must show: written down once, asserted on the vLLM that is installed.

Keyed by fix first (``fixes.REGISTRY`` NAMEs), then by environment ``(vLLM release, transformers version)``, so that a
new fix adds one block. The value is the verdict the fix's ``probe`` returns on *stock* vLLM there. Every fix of the
registry must have a block and every environment of the run a row in it: :func:`verdict` fails (never skips) on an
environment or a fix the table does not know -- a new vLLM or transformers that changes a verdict must be measured
and added, not passed over.
"""

from __future__ import annotations

ATTN = "MiniCPMV4_6ViTWindowAttentionSelfAttn"

#: The environments of the run: (vLLM release, transformers version), as locks/*.txt pin them.
ENVIRONMENTS = (
    ("0.22.1", "5.24.0"),
    ("0.23.0", "5.24.0"),
    ("0.24.0", "5.24.0"),
    ("0.26.0", "5.24.0"),
    ("0.28.0", "5.24.0"),
    ("0.28.0", "5.20.0"),
    ("0.30.0", "5.24.0"),
    ("0.32.0", "5.19.0"),
    ("0.33.0", "5.20.2"),
)

#: fix NAME -> environment -> verdict of the fix's probe on stock vLLM.
VERDICTS: dict[str, dict[tuple[str, str], str]] = {
    "qkv_loader": {
        ("0.22.1", "5.24.0"): "correct",
        ("0.23.0", "5.24.0"): "correct",
        ("0.24.0", "5.24.0"): "correct",
        ("0.26.0", "5.24.0"): "broken",
        ("0.28.0", "5.24.0"): "broken",
        ("0.28.0", "5.20.0"): "broken",
        ("0.30.0", "5.24.0"): "correct",
        ("0.32.0", "5.19.0"): "correct",
        ("0.33.0", "5.20.2"): "correct",
    },
    "processor_downsample_mode": {
        # transformers >= 5.23 takes a required downsample_mode that 0.22-0.30 do not pass; 0.31+ pin it below 5.23.
        ("0.22.1", "5.24.0"): "broken",
        ("0.23.0", "5.24.0"): "broken",
        ("0.24.0", "5.24.0"): "broken",
        ("0.26.0", "5.24.0"): "broken",
        ("0.28.0", "5.24.0"): "broken",
        ("0.28.0", "5.20.0"): "correct",
        ("0.30.0", "5.24.0"): "broken",
        ("0.32.0", "5.19.0"): "correct",
        ("0.33.0", "5.20.2"): "correct",
    },
    "hf_processor_version": {
        # 0.23.0 alone wraps transformers' 4.6 processor in vLLM's legacy MiniCPMVProcessor, which reads `version`.
        **{env: ("broken" if env[0] == "0.23.0" else "correct") for env in ENVIRONMENTS},
    },
    "mm_placeholders": {
        # Every release ignores slice_mode: false, a request's scale_resolution and use_image_id: false; 0.22-0.24 lay
        # the slices out wrongly as well (tests/prompt/test_prompt_conformance.py pins which sub-defect where).
        **{env: "broken" for env in ENVIRONMENTS},
    },
    "video_image_id_cache": {
        # A cached video keeps its old <image_id> index up to 0.25.0; 0.26 rewrites it.
        **{env: ("broken" if env[0] in ("0.22.1", "0.23.0", "0.24.0") else "correct") for env in ENVIRONMENTS},
    },
    "quantized_vision": {
        # Every release builds the vision tower AWQ although modules_to_not_convert names model.vision_tower
        # (transformers' name; vLLM's prefix rules end in a dot and never map it to vpm).
        **{env: "broken" for env in ENVIRONMENTS},
    },
    "unsupported_quant_method": {
        # bitsandbytes is in vLLM's quantization registry up to 0.26 and gone from 0.27 on.
        **{env: ("correct" if env[0] in ("0.22.1", "0.23.0", "0.24.0", "0.26.0") else "broken") for env in ENVIRONMENTS},
    },
    "qkv_completeness_guard": {
        # stock vLLM loads a checkpoint missing a vit_merger q/k/v shard without an error where its own q/k/v loading
        # is correct; 0.25-0.29 refuse every 4.6 checkpoint anyway (and the q/k/v loader fix checks there).
        ("0.22.1", "5.24.0"): "broken",
        ("0.23.0", "5.24.0"): "broken",
        ("0.24.0", "5.24.0"): "broken",
        ("0.26.0", "5.24.0"): "correct",
        ("0.28.0", "5.24.0"): "correct",
        ("0.28.0", "5.20.0"): "correct",
        ("0.30.0", "5.24.0"): "broken",
        ("0.32.0", "5.19.0"): "broken",
        ("0.33.0", "5.20.2"): "broken",
    },
    "encoder_modes": {
        # One mode per encoder batch and no per-video flag in 0.22-0.31; 0.32 groups items by flag.
        **{env: ("correct" if env[0] in ("0.32.0", "0.33.0") else "broken") for env in ENVIRONMENTS},
    },
    "video_tower": {
        # Every release marks the vision tower for the image modality only.
        **{env: "broken" for env in ENVIRONMENTS},
    },
    "video_budget": {
        # Every release profiles 16 frames per video while its loader samples 32.
        **{env: "broken" for env in ENVIRONMENTS},
    },
    "video_loader": {
        # 0.24-0.31 fall back to transformers' model_type mapping, a dict from transformers 5.19 on; 0.22 looks nothing
        # up, 0.23 has no fallback (None), 0.32 reads the dict's "torchvision" entry.
        **{env: ("broken" if env[0] in ("0.24.0", "0.26.0", "0.28.0", "0.30.0") else "correct") for env in ENVIRONMENTS},
    },
    "lora_support": {
        # 0.25 adds SupportsLoRA to the 4.6 class's bases (vLLM #46740); 0.22-0.24 refuse --enable-lora.
        **{env: ("broken" if env[0] in ("0.22.1", "0.23.0", "0.24.0") else "correct") for env in ENVIRONMENTS},
    },
    "lora_tower": {
        # No release's MiniCPM-V class gives vLLM's LoRA manager a vision-encoder token count (SupportsMultiModal's
        # get_num_mm_encoder_tokens stub answers None): a tower/connector adapter loads and is ignored everywhere.
        **{env: "broken" for env in ENVIRONMENTS},
    },
    "placeholder_guard": {
        # No release compares a request's placeholder and embedding counts before the engine.
        **{env: "broken" for env in ENVIRONMENTS},
    },
    "request_kwargs": {
        # No release checks a request's MiniCPM-V mm_processor_kwargs before transformers' processor runs.
        **{env: "broken" for env in ENVIRONMENTS},
    },
    "ocr_video_kwargs": {
        # A MiniCPM-OCR fix: vLLM's 4.6 class has no OCR process_videos (nothing to correct, not applicable).
        **{env: "correct" for env in ENVIRONMENTS},
    },
    "canvas_mrope": {
        # A 4.7 fix: vLLM's 4.6 class has no canvas M-RoPE (nothing to correct, not applicable); its 4.7 row below.
        **{env: "correct" for env in ENVIRONMENTS},
    },
}
#: The verdict of canvas_mrope on vLLM 0.32-0.33's own 4.7 classes (V47_OWN): the canvas is off for a config
#: transformers wrote. The hotfix's backport of 4.7 (0.22-0.30) has no canvas switch: "correct", as on 4.6.
CANVAS_ON_47 = "broken"
V47_OWN = ("0.32.0", "0.33.0")

#: The family members other than 4.6 -> the environments that have them (vLLM defines their classes and transformers
#: their processor) -> fix NAME -> the verdict of the fix's probe on that member's *own* classes on stock vLLM (what
#: ``status()["fixes"][NAME]["models"][member]["verdict"]`` records), or "n/a" where the fix does not declare the
#: member. MiniCPM-V 4.7 on 0.32.0 / 0.33.0: measured equal to 4.6's verdict for every fix that declares it (4.7
#: inherits every method the fixes set; its overrides call super()).
#: The fix that does not declare MiniCPM-V 4.7 (its 4.7 row is "n/a"): 4.7's videos have no local <image_id> to
#: renumber.
#: On 0.22-0.30 4.7's classes are the backport's (vllm_minicpm_hotfix.backports.models.minicpmv4_7, subclasses of
#: that release's 4.6 classes): measured equal to 4.6's verdict there too, for every fix that declares 4.7
#: (2026-12-02, every environment of ENVIRONMENTS).
NOT_ON_47 = {"video_image_id_cache", "ocr_video_kwargs"}

#: The fixes that declare MiniCPM-OCR (their ``MODELS``).
OCR_FIXES: set[str] = {"video_budget", "video_tower", "request_kwargs", "processor_downsample_mode", "placeholder_guard",
                      "mm_placeholders", "encoder_modes", "qkv_completeness_guard", "ocr_video_kwargs", "qkv_loader"}
#: Where OCR's own verdict is not 4.6's: processor_downsample_mode is "correct" on OCR everywhere -- the backport's
#: _compute_visual_tokens hands transformers the mode itself (0.22-0.30 with 5.24; measured on 0.22.1 and 0.28.0), and
#: elsewhere transformers (< 5.23) takes none (0.33.0 measured; the others by 4.6's "correct" there).
OCR_OWN: dict[str, str] = {"processor_downsample_mode": "correct"}
#: vLLM 0.33's own OCR classes: OCR's own ``process_videos`` hands the image processor upsize options
#: (``disable_small_image_upsize``, ...) that no released transformers' image processor takes (TypeError; measured on
#: 0.33.0, and on 0.33.0:tf5.24.0 with transformers' own OCR processor). encoder_modes judges OCR's video on the 4.6
#: ``process_videos`` it inherits there: 4.6's verdict.
OCR_OWN_033: dict[str, str] = {"ocr_video_kwargs": "broken"}

MEMBER_VERDICTS: dict[str, dict[tuple[str, str], dict[str, str]]] = {
    "MiniCPM-V 4.7": {
        env: {fix: ("n/a" if fix in NOT_ON_47 else CANVAS_ON_47 if fix == "canvas_mrope" and env[0] in V47_OWN
                    else block[env]) for fix, block in VERDICTS.items()}
        for env in ENVIRONMENTS
    },
    # MiniCPM-OCR's classes are present everywhere: vLLM's own on 0.33.0, the backport's module elsewhere (it
    # imports without transformers' minicpm_ocr; only vLLM's registry decides whether it is served). The fixes that
    # declare OCR (its classes inherit their defects) probe them: the verdict is 4.6's (OCR_FIXES); the others "n/a".
    "MiniCPM-OCR": {env: {fix: ((OCR_OWN_033 if env[0] == "0.33.0" else {}).get(fix) or OCR_OWN.get(fix, block[env])
                                if fix in OCR_FIXES else "n/a")
                          for fix, block in VERDICTS.items()}
                    for env in ENVIRONMENTS},
}

#: backport NAME (``vllm_minicpm_hotfix.backports.BACKPORTS``) -> environment -> the verdict of its probe on stock
#: vLLM: ``missing`` where vLLM's registry lacks the architecture (the backport registers it there), ``correct``
#: where vLLM registers it itself ("vLLM's own").
BACKPORT_VERDICTS: dict[str, dict[tuple[str, str], str]] = {
    # vLLM registers MiniCPMV4_7ForConditionalGeneration from 0.32 on; every environment's transformers has 4.7.
    "minicpmv4_7": {env: ("correct" if env[0] in ("0.32.0", "0.33.0") else "missing") for env in ENVIRONMENTS},
    # vLLM registers MiniCPMOcrForConditionalGeneration from 0.33 on; transformers has minicpm_ocr from 5.24 (not in
    # 0.28.0:tf5.20.0, 0.32.0's 5.19.0 nor 0.33.0's 5.20.2): there a checkpoint's config cannot be read.
    # 0.33.0's own class with its transformers 5.20.2 is "unrecognised" too: vLLM cannot read the config.
    "minicpm_ocr": {env: ("missing" if env[1] == "5.24.0" else "unrecognised") for env in ENVIRONMENTS},
}


#: Environments measured to give exactly another environment's verdicts -- every fix on 4.6, on every member's classes,
#: and every backport -- so their rows are that environment's: 0.28.0:unpinned resolved transformers 5.25.0 on
#: 2026-12-04 (released after the locks were written), and its report was equal to 0.28.0 with 5.24.0 in all of them
#: (scripts/test of f01fc0b). A verdict that differs must be measured and written out instead.
SAME_AS: dict[tuple[str, str], tuple[str, str]] = {("0.28.0", "5.25.0"): ("0.28.0", "5.24.0")}
for _new, _old in SAME_AS.items():
    ENVIRONMENTS += (_new,)
    for _table in (*VERDICTS.values(), *BACKPORT_VERDICTS.values(), *MEMBER_VERDICTS.values()):
        if _old in _table:
            _table[_new] = _table[_old]


def backport_verdict(name: str, env: tuple[str, str]) -> str:
    """The pinned stock verdict of backport ``name`` in ``env``."""
    if env not in ENVIRONMENTS:
        raise UnknownEnvironment(f"vLLM {env[0]} with transformers {env[1]} is not an environment of tests/support/expected.py")
    return BACKPORT_VERDICTS[name][env]


def member_verdicts(member: str, env: tuple[str, str]) -> dict[str, str] | None:
    """The pinned stock verdicts of every fix on ``member``'s classes in ``env`` (None: the member is absent there)."""
    if env not in ENVIRONMENTS:
        raise UnknownEnvironment(f"vLLM {env[0]} with transformers {env[1]} is not an environment of tests/support/expected.py")
    return MEMBER_VERDICTS[member].get(env)


#: vLLM release -> the error stock vLLM raises loading a 4.6 checkpoint (None: it loads).
STOCK_LOAD_ERROR: dict[str, str | None] = {
    "0.22.1": None,
    "0.23.0": None,
    "0.24.0": None,
    "0.26.0": f"There is no module or parameter named 'qkqkv_proj' in {ATTN}",
    "0.28.0": f"There is no module or parameter named 'k_proj' in {ATTN}",
    "0.30.0": None,
    "0.32.0": None,
    "0.33.0": None,
}


class UnknownEnvironment(LookupError):
    pass


def installed_environment() -> tuple[str, str]:
    """``(vLLM release without the local part, transformers version)`` of this interpreter."""
    import transformers
    import vllm

    return vllm.__version__.split("+")[0], transformers.__version__


def verdict(fix: str, env: tuple[str, str]) -> str:
    """The pinned stock verdict of ``fix`` in ``env``. Raises :class:`UnknownEnvironment` naming what to measure."""
    if env not in ENVIRONMENTS:
        raise UnknownEnvironment(
            f"vLLM {env[0]} with transformers {env[1]} is not an environment of tests/support/expected.py: measure it and add "
            f"it to ENVIRONMENTS and to every fix's block of VERDICTS"
        )
    block = VERDICTS.get(fix)
    if block is None or env not in block:
        raise UnknownEnvironment(f"tests/support/expected.py VERDICTS has no verdict of fix {fix!r} for {env}: measure it")
    return block[env]


def stock_load_error(release: str) -> str | None:
    if release not in STOCK_LOAD_ERROR:
        raise UnknownEnvironment(f"vLLM {release} is not in tests/support/expected.py STOCK_LOAD_ERROR: measure it and add it")
    return STOCK_LOAD_ERROR[release]
