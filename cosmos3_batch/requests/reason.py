"""Checks of the `reason` object (DESIGN.md §21): the reasoner half of the checkpoint, text (and an image or a
video) in, text out. Like `action`, its presence selects the mode (kind `reason`); its sampling knobs are
transformers' `generate` arguments of the same names. No torch here: the clip is probed as V2V's is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cosmos3_batch.requests.fields import (
    _ABSENT,
    ALLOWED_KEYS,
    LineErrors,
    ModelLimits,
    _check_text,
    _get,
    _number,
    _show,
    check_image,
    describe,
)

DEFAULT_MAX_NEW_TOKENS = 1024  # NVIDIA's reasoner mode's default
MAX_NEW_TOKENS = 65536
REASON_KEYS = (
    "max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "repetition_penalty", "presence_penalty",
    "system", "video_fps",
)  # fmt: skip
# The only top-level keys a reasoner line may carry: everything else drives generation.
TOP_LEVEL = ("id", "prompt", "image", "video", "seed", "samples", "reason")
GENERATION_ONLY = tuple(key for key in ALLOWED_KEYS if key not in TOP_LEVEL)


@dataclass(frozen=True)
class ReasonSpec:
    """One reasoner request's decoding: None = the checkpoint's generation config decides (as `generate`)."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    do_sample: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None  # subtracted once from every token already in the sequence
    system: str | None = None  # a system message before the user's
    video_fps: float | None = None  # frames per second sampled from `video` (None: the video processor's)

    def generate_kwargs(self) -> dict[str, Any]:
        """The `generate` arguments this spec stands for (presence_penalty is a logits processor of ours)."""
        names = ("max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "repetition_penalty")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


def has_reason(obj: dict[str, Any]) -> bool:
    return _get(obj, "reason") is not _ABSENT


# key -> (integer?, low, low allowed?, high)
_RULES: dict[str, tuple[bool, float, bool, float]] = {
    "max_new_tokens": (True, 1, True, MAX_NEW_TOKENS),
    "temperature": (False, 0, False, 100),
    "top_k": (True, 1, True, 1_000_000),
    "top_p": (False, 0, False, 1),
    "repetition_penalty": (False, 0, False, 100),
    "presence_penalty": (False, -100, True, 100),
    "video_fps": (False, 0, False, 240),
}


def check_reason(out: LineErrors, obj: dict[str, Any], limits: ModelLimits) -> ReasonSpec | None:
    """The `reason` object itself; None after reporting why it is not one."""
    value = _get(obj, "reason")
    if not isinstance(value, dict):
        out.add("reason", f"must be an object (its fields: {', '.join(REASON_KEYS)}), got {describe(value)}")
        return None
    if limits.reasoner_missing:
        missing = "; ".join(limits.reasoner_missing)
        out.add("reason", f"this checkpoint has no reasoner parts: {missing} (make-tiny --reasoner has them)")
    before = len(out.errors)
    for key in getattr(value, "duplicates", ()):
        out.add(f"reason.{key}", "key appears more than once in this object")
    for key in value:
        if key not in REASON_KEYS:
            out.add(f"reason.{key}", f"unknown key {_show(key)}; allowed: {', '.join(REASON_KEYS)}")
    fields: dict[str, Any] = {}
    for key, (integer, low, low_ok, high) in _RULES.items():
        raw = value.get(key)
        if raw is None:
            continue
        number = _number(out, f"reason.{key}", raw, integer)
        if number is not None and not (low <= number <= high and (low_ok or number != low)):
            bound = ">=" if low_ok else ">"
            out.add(f"reason.{key}", f"must be {bound} {low} and <= {high}, got {describe(number)}")
        fields[key] = number
    if value.get("do_sample") is not None:
        if not isinstance(value["do_sample"], bool):
            out.add("reason.do_sample", f"must be true or false, got {describe(value['do_sample'])}")
        fields["do_sample"] = value["do_sample"]
    if value.get("system") is not None:
        fields["system"] = _check_text(out, "reason.system", value["system"])
    if len(out.errors) > before:
        return None
    return ReasonSpec(**fields)


def check_reason_request(
    out: LineErrors, obj: dict[str, Any], base_dir: str | None, limits: ModelLimits
) -> tuple[dict[str, Any], int]:
    """The Request fields of a reasoner line (generation fields at their defaults, unused); frame count 1."""
    from cosmos3_batch.requests.modes import check_video_path

    for key in GENERATION_ONLY:
        if _get(obj, key) is not _ABSENT:
            out.add(key, "drives generation: a reasoner request (reason) takes prompt, image or video, seed")
    spec = check_reason(out, obj, limits)
    image_given, video_given = _get(obj, "image") is not _ABSENT, _get(obj, "video") is not _ABSENT
    # check_image refuses an image for a 1-frame output (that is I2V's rule): here any image is input.
    image = check_image(out, obj, base_dir, None) if image_given else None
    video = check_video_path(out, _get(obj, "video"), base_dir) if video_given else None
    if image_given and video_given:
        out.add("video", "give the reasoner an image or a video, not both")
    if spec is not None and spec.video_fps is not None and not video_given:
        out.add("reason.video_fps", "is only used with a video")
    values: dict[str, Any] = {
        "reason": spec,
        "width": 0,
        "height": 0,
        "image": image,
        "video": video,
        "condition_frames": None,
        "condition_video_keep": None,
        "sound": False,
    }
    return values, 0  # no frames out: its output is text (io/outputs.py paths_for: `<id>.txt`)


def decode_passes(spec: ReasonSpec) -> int:
    """Passes a reasoner request rides at most: its prefill (which yields the first token), then one per
    further token (EOS may end it sooner)."""
    return spec.max_new_tokens
