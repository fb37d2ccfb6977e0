"""Checks of the fields that pick a generation mode beyond T2I/T2V/I2V (DESIGN.md §9): video-to-video and
the system prompt. Like requests/fields.py: every check reports into a `LineErrors`, returns what it could
read, and imports no torch (the clip is probed with imageio, the decoder `diffusers.utils.load_video` uses).
"""

from __future__ import annotations

import os
from typing import Any

from cosmos3_batch.requests.fields import _ABSENT, LineErrors, ModelLimits, _check_text, _get, _show, describe

DEFAULT_CONDITION_FRAMES = (0, 1)  # the reference's `condition_frame_indexes_vision` default
VIDEO_KEEP = ("first", "last")


def resolve_path(base_dir: str | None, value: str) -> str:
    return os.path.abspath(os.path.join(base_dir if base_dir is not None else os.getcwd(), value))


def check_video(
    out: LineErrors, obj: dict[str, Any], base_dir: str | None, num_frames: int | None, temporal_factor: int
) -> dict[str, Any]:
    """`video`, `condition_frames`, `condition_video_keep`: resolved values, or the no-video defaults."""
    value = _get(obj, "video")
    frames_given = _get(obj, "condition_frames") is not _ABSENT
    keep_given = _get(obj, "condition_video_keep") is not _ABSENT
    if value is _ABSENT:
        for key, given in (("condition_frames", frames_given), ("condition_video_keep", keep_given)):
            if given:
                out.add(key, "is only used with video (video-to-video); add a video or remove it")
        return {"video": None, "condition_frames": None, "condition_video_keep": None}
    path = check_video_path(out, value, base_dir)
    if _get(obj, "image") is not _ABSENT:
        out.add("video", "give either image (image-to-video) or video (video-to-video), not both")
    if num_frames == 1:
        out.add("video", "video conditioning needs a video output (num_frames > 1), but num_frames is 1")
    keep = _get(obj, "condition_video_keep")
    if keep is _ABSENT:
        keep = "first"
    elif keep not in VIDEO_KEEP:
        out.add("condition_video_keep", f'must be "first" or "last", got {describe(keep)}')
        keep = None
    return {
        "video": path,
        "condition_frames": _check_condition_frames(out, obj, num_frames, temporal_factor),
        "condition_video_keep": keep,
    }


def check_video_path(out: LineErrors, value: Any, base_dir: str | None) -> str | None:
    if (value := _check_text(out, "video", value)) is None:
        return None
    if not value:
        out.add("video", "must be a path to a video file, got an empty string")
        return None
    path = resolve_path(base_dir, value)
    if os.path.islink(path) and not os.path.exists(path):
        out.add("video", f"{path} is a symbolic link to {os.readlink(path)!r}, which does not exist")
        return None
    if not os.path.isfile(path):
        out.add("video", f"video file not found: {path}")
        return None
    problem = probe_video(path)
    if problem is not None:
        out.add("video", f"{path} {problem}")
    return path


def probe_video(path: str) -> str | None:
    """Decode every frame the way `diffusers.utils.load_video` will at run time; None if usable, else why not.

    A full decode rather than a header read: a clip cut off mid-stream must stop the job here, not after the
    weights are loaded.
    """
    return count_frames(path)[1]


def count_frames(path: str) -> tuple[int | None, str | None]:
    """(frames, None) for a usable clip, decoded as `probe_video` decodes it; else (None, why not)."""
    if not os.path.isfile(path):
        return None, "not found"
    try:
        if path.endswith(".gif"):  # load_video reads GIFs with PIL, everything else with imageio
            count, mode = _gif_frames(path)
            if mode != "RGB":
                # load_video keeps GIF frames in their own mode; the pipeline's preprocessing needs RGB.
                return None, f"has {mode!r} frames; the pipeline needs RGB frames (convert the clip to MP4)"
        else:
            import imageio

            with imageio.get_reader(path) as reader:
                count = sum(1 for _ in reader)
    except Exception as exc:  # imageio/ffmpeg/PIL report bad files with many exception types
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return None, f"is not a readable video ({type(exc).__name__}: {_show(first)})"
    if count == 0:
        return None, "has no frames"
    return count, None


def _gif_frames(path: str) -> tuple[int, str]:
    from PIL import Image

    with Image.open(path) as gif:
        mode, count = gif.mode, 0
        try:
            while True:
                gif.load()
                count += 1
                gif.seek(gif.tell() + 1)
        except EOFError:
            pass
    return count, mode


def _check_condition_frames(
    out: LineErrors, obj: dict[str, Any], num_frames: int | None, temporal_factor: int
) -> tuple[int, ...] | None:
    value = _get(obj, "condition_frames")
    if value is _ABSENT:
        return DEFAULT_CONDITION_FRAMES
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        out.add(
            "condition_frames", f"must be a list of latent frame indexes, e.g. [0, 1], got {describe(value)}"
        )
        return None
    if not value:
        out.add("condition_frames", "must name at least one latent frame to keep clean")
        return None
    if min(value) < 0:
        out.add("condition_frames", f"indexes must be >= 0, got {value}")
        return None
    if num_frames is not None and num_frames > 1:
        latent_t = (num_frames - 1) // temporal_factor + 1
        if max(value) >= latent_t:
            out.add(
                "condition_frames",
                f"index {max(value)} is outside the latent timeline: {num_frames} frames are {latent_t} "
                f"latent frames (indexes 0..{latent_t - 1})",
            )
            return None
    return tuple(value)


def check_system_prompt(out: LineErrors, obj: dict[str, Any]) -> bool | None:
    """None = the checkpoint's `default_use_system_prompt`."""
    value = _get(obj, "system_prompt")
    if value is _ABSENT:
        return None
    if not isinstance(value, bool):
        out.add("system_prompt", f"must be true or false, got {describe(value)}")
        return None
    return value


def check_sound(out: LineErrors, obj: dict[str, Any], limits: ModelLimits, num_frames: int | None) -> bool:
    value = _get(obj, "sound")
    if value is _ABSENT:
        return False
    if not isinstance(value, bool):
        out.add("sound", f"must be true or false, got {describe(value)}")
        return False
    if value and num_frames == 1:
        out.add("sound", "joint audio needs a video (num_frames > 1), but num_frames is 1")
    if value and limits.sound is False:
        out.add("sound", "this checkpoint cannot generate sound: it has no sound_tokenizer or no sound_gen")
    return value


def checkpoint_modes(model_index: dict, transformer_config: dict) -> dict[str, bool]:
    """ModelLimits fields saying which extra modalities a checkpoint supports (read from its configs only)."""
    tokenizer = model_index.get("sound_tokenizer")
    has_tokenizer = isinstance(tokenizer, list) and bool(tokenizer) and tokenizer[0] is not None
    action = bool(transformer_config.get("action_gen", False))
    return {
        "sound": has_tokenizer and bool(transformer_config.get("sound_gen", False)),
        "action": action,
        "action_dim": int(transformer_config["action_dim"]) if action else None,
    }


def check_distilled(
    out: LineErrors, obj: dict[str, Any], values: dict[str, Any], limits: ModelLimits
) -> None:
    """What a distilled checkpoint fixes (Cosmos3DistilledModularPipeline raises on the same values).
    `values`: the request's checked numbers."""
    if not limits.defaults.distilled:
        return
    steps = limits.defaults.image_steps
    if values["num_inference_steps"] not in (None, steps):
        out.add(
            "num_inference_steps",
            f"{values['num_inference_steps']}: this distilled checkpoint's schedule is fixed at {steps} "
            f"steps (its distilled_sigmas); use {steps} or leave it out",
        )
    if values["guidance_scale"] not in (None, 1.0):
        out.add(
            "guidance_scale",
            f"{describe(values['guidance_scale'])}: guidance is baked into this distilled checkpoint's "
            "weights; use 1.0 or leave it out",
        )
    if _get(obj, "negative_prompt") is not _ABSENT:
        out.add(
            "negative_prompt", "a distilled checkpoint has no unconditional branch (guidance is baked in)"
        )
    if _get(obj, "flow_shift") is not _ABSENT:
        out.add(
            "flow_shift", "a distilled checkpoint's sigmas are fixed (its distilled_sigmas); leave it out"
        )
    for key in (
        "sound",
        "action",
    ):  # Cosmos3DistilledBlocks: text2image, text2video, image2video, video2video
        if _get(obj, key) not in (_ABSENT, False):
            out.add(key, "a distilled checkpoint generates images and videos only (T2I, T2V, I2V, V2V)")
