"""An NVIDIA cosmos-framework sample -> the request it means in this tool's own format (DESIGN.md §24).

A sample becomes the JSON object a user would have written for this tool, and that object goes through the
same field checks as every other request (requests/parse.py), so the two formats cannot drift apart. Each
field is mapped or refused by name (requests/cosmos_table.py); a field the sample leaves out takes NVIDIA's
default for the sample's mode. Errors come back under the names the user wrote. Torch-free.
"""

from __future__ import annotations

import difflib
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from cosmos3_batch.requests import cosmos_table as table
from cosmos3_batch.requests.fields import JsonObject, ModelLimits, describe
from cosmos3_batch.requests.modes import resolve_path


@dataclass
class Translation:
    """What one sample becomes: this tool's request object, and what the user should know about it."""

    mode: str | None = None
    obj: JsonObject = field(default_factory=JsonObject)
    errors: list[tuple[str | None, str]] = field(default_factory=list)  # (NVIDIA field, message)
    defaults: list[str] = field(default_factory=list)  # NVIDIA fields filled from its per-mode defaults
    notes: list[str] = field(default_factory=list)

    def refuse(self, key: str | None, message: str) -> None:
        self.errors.append((key, message))

    def record(self) -> dict[str, Any]:
        return {
            "model_mode": self.mode,
            "request": dict(self.obj),
            "defaults": self.defaults,
            "notes": self.notes,
        }


def translate(sample: dict[str, Any], name: str, base_dir: str, limits: ModelLimits) -> Translation:
    t = Translation()
    _check_keys(t, sample)
    for key in ("vision_path", "action_path", "sound_path", *(f"{h}.control_path" for h in table.HINTS)):
        value = _lookup(sample, key)
        if isinstance(value, str) and "://" in value:
            t.refuse(key, f"{value!r} is a URL: this tool downloads nothing; download it and give its path")
    t.mode = _mode(t, sample)
    if t.mode is None:
        return t
    t.obj["id"] = name
    _text(t, sample, base_dir)
    if t.mode == table.REASONER:  # text out: the sample's fields beside the prompt go to `reason`
        _reasoner(t, sample)
        return t
    for key in table.REASONER_FIELDS:
        if sample.get(key) is not None:
            t.refuse(key, "is a reasoner field: it needs model_mode reasoner")
    for theirs, ours in (("seed", "seed"), ("guidance_interval", "guidance_interval"), ("fps", "fps")):
        if theirs in sample:
            t.obj[ours] = sample[theirs]
    outputs = sample.get("num_outputs")
    if outputs != 1 and outputs is not None:  # one output keeps its name; N become <name>-<k>, seed + k
        t.obj["samples"] = outputs
    if sample.get("enable_sound") is not None:
        t.obj["sound"] = sample["enable_sound"]
    hints = [hint for hint in table.HINTS if sample.get(hint) is not None]
    if hints:
        _transfer(t, sample, hints, limits)
    elif t.mode in table.ACTION_MODES:
        _action(t, sample)
    else:
        _vision(t, sample, limits)
    _sampling(t, sample, hints, limits)
    return t


def _reasoner(t: Translation, sample: dict[str, Any]) -> None:
    """model_mode reasoner: this tool's `reason` request (the image or video from vision_path, the sampling
    fields as they are, num_outputs and seed as for every sample); a generation field beside it is refused
    by the request's own checks, under the name the sample gave."""
    for theirs in ("seed", "num_outputs"):
        if sample.get(theirs) is not None:
            t.obj["seed" if theirs == "seed" else "samples"] = sample[theirs]
    path = sample.get("vision_path")
    if isinstance(path, str):
        image = os.path.splitext(path)[1].lower() in table.IMAGE_SUFFIXES
        t.obj["image" if image else "video"] = path
    t.obj["reason"] = {key: sample[key] for key in table.REASONER_FIELDS if sample.get(key) is not None}
    for key in ("num_steps", "guidance", "shift", "resolution", "num_frames", "fps", "negative_prompt"):
        if sample.get(key) is not None:
            t.refuse(key, "is a generation field: a reasoner sample has text out (model_mode reasoner)")


def _lookup(sample: dict[str, Any], key: str) -> Any:
    head, _, tail = key.partition(".")
    value = sample.get(head)
    return value.get(tail) if tail and isinstance(value, dict) else (value if not tail else None)


def _check_keys(t: Translation, sample: dict[str, Any]) -> None:
    for key in getattr(sample, "duplicates", ()):
        t.refuse(key, "key appears more than once in this sample")
    for key in sample:
        if key not in table.KNOWN:
            close = difflib.get_close_matches(str(key), sorted(table.KNOWN), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            t.refuse(str(key), f"unknown key: NVIDIA's cosmos-framework samples have no such field{hint}")
        elif (
            key in table.REFUSED and sample[key] is not None and sample[key] != table.NEUTRAL.get(key, _NONE)
        ):
            t.refuse(key, f"not supported: {table.REFUSED[key]}")
    for hint in table.HINTS:
        value = sample.get(hint)
        if value is None:
            continue
        if not isinstance(value, dict):
            t.refuse(
                hint, f"must be an object with {', '.join(table.PLAIN_HINT_KEYS)}, got {describe(value)}"
            )
            continue
        allowed = table.HINT_KEYS.get(hint, table.PLAIN_HINT_KEYS)
        for key in value:
            if key not in allowed:
                t.refuse(f"{hint}.{key}", f"unknown key; allowed: {', '.join(allowed)}")
        if value.get("weight") not in (None, 1, 1.0):
            t.refuse(
                f"{hint}.weight", "not supported: diffusers' Transfer pipeline weighs every control equally"
            )
        for key in ("preset_edge_threshold", "preset_blur_strength"):
            if value.get(key) not in (None, "medium"):
                t.refuse(f"{hint}.{key}", 'not supported: controls are derived with the "medium" preset only')


_NONE = object()


def _mode(t: Translation, sample: dict[str, Any]) -> str | None:
    """The sample's mode: `model_mode`, or as NVIDIA infers it from `vision_path` and `num_frames`."""
    explicit = sample.get("model_mode")
    if explicit in table.REFUSED_MODES:
        t.refuse("model_mode", f"{explicit!r} is not supported: {table.REFUSED_MODES[explicit]}")
        return None
    known = (*table.VFM_MODES, *table.ACTION_MODES, table.REASONER, *table.REFUSED_MODES)
    if explicit is not None and explicit not in known:
        t.refuse("model_mode", f"must be one of {', '.join(known)}, got {describe(explicit)}")
        return None
    if explicit in table.ACTION_MODES or explicit == table.REASONER:
        return explicit
    path = sample.get("vision_path")
    kind = "text"
    if isinstance(path, str):
        suffix = os.path.splitext(path)[1].lower()
        kind = (
            "image" if suffix in table.IMAGE_SUFFIXES else "video" if suffix in table.VIDEO_SUFFIXES else ""
        )
        if not kind:
            allowed = ", ".join(table.IMAGE_SUFFIXES + table.VIDEO_SUFFIXES)
            t.refuse("vision_path", f"{path!r}: NVIDIA's CLI takes {allowed} (an image or a video)")
            return None
    frames = sample.get("num_frames", 1 if explicit == "text2image" else None)
    inferred = f"{kind}2{'image' if frames == 1 else 'video'}"
    if explicit is not None and explicit != inferred:
        t.refuse(
            "model_mode",
            f"{explicit!r} does not fit the sample: vision_path and num_frames make it {inferred}",
        )
        return None
    if inferred not in table.VFM_MODES:
        t.refuse("num_frames", f"{inferred} is not a mode: a {kind} condition needs a video (num_frames > 1)")
        return None
    return inferred


def _text(t: Translation, sample: dict[str, Any], base_dir: str) -> None:
    for theirs, ours, reader in (
        ("prompt_path", "prompt", _read_prompt),
        ("negative_prompt_file", "negative_prompt", _read_negative),
    ):
        if sample.get(ours) is not None:
            t.obj[ours] = sample[ours]
            if sample.get(theirs) is not None:
                t.refuse(theirs, f"give {ours} or {theirs}, not both")
        elif sample.get(theirs) is not None:
            value = sample[theirs]
            if not isinstance(value, str):
                t.refuse(theirs, f"must be a path, got {describe(value)}")
                continue
            text, problem = reader(resolve_path(base_dir, value), bool(set(table.HINTS) & set(sample)))
            if problem is not None:
                t.refuse(theirs, problem)
            else:
                t.obj[ours] = text


def _read_prompt(path: str, transfer: bool) -> tuple[str | None, str | None]:
    """As `_build_text_data`: a Transfer sample's .json prompt is re-serialized, any other text stripped."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if transfer and path.lower().endswith(".json"):
            return json.dumps(json.loads(text)), None
        return text.strip(), None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return None, f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}"


def _read_negative(path: str, _transfer: bool) -> tuple[str | None, str | None]:
    """As `_load_transfer_negative_prompt_file`: a JSON file, re-serialized (NVIDIA's own defaults/ folder,
    its fallback for a bare file name, is not shipped here)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.dumps(json.loads(f.read())), None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return None, f"cannot read {path} as JSON: {getattr(exc, 'strerror', None) or exc}"


def _frames(t: Translation, sample: dict[str, Any], default: int | None, limits: ModelLimits) -> None:
    """num_frames, rounded up to 4k+1 as NVIDIA's `_build_vision_data` rounds it."""
    frames = sample.get("num_frames")
    if frames is None:
        frames = default
        if frames is None:
            return
        t.defaults.append("num_frames")
    if isinstance(frames, int) and not isinstance(frames, bool) and frames >= 1:
        step = limits.temporal_factor
        rounded = math.ceil((frames - 1) / step) * step + 1
        if rounded != frames:
            t.notes.append(f"num_frames {frames} rounded up to {rounded} (4k+1), as NVIDIA's CLI does")
        frames = rounded
    t.obj["num_frames"] = frames


def _size(t: Translation, sample: dict[str, Any], limits: ModelLimits, image: bool) -> None:
    tier = sample.get("resolution")
    if tier is None:
        tier = table.DEFAULT_TIER.get(limits.defaults.family, table.FALLBACK_TIER)
        t.defaults.append("resolution")
    aspect = sample.get("aspect_ratio")
    if aspect is None:
        aspect = table.DEFAULT_ASPECT
        t.defaults.append("aspect_ratio")
    if tier not in table.SIZES:
        t.refuse("resolution", f"must be one of {', '.join(map(repr, table.SIZES))}, got {describe(tier)}")
    elif tier in table.IMAGE_ONLY and not image:
        t.refuse("resolution", f"{tier!r} makes images only (num_frames 1), as in NVIDIA's CLI")
    elif aspect not in table.SIZES[tier]:
        t.refuse(
            "aspect_ratio",
            f"must be one of {', '.join(map(repr, table.SIZES[tier]))}, got {describe(aspect)}",
        )
    else:
        width, height = table.SIZES[tier][aspect]
        t.obj["size"] = f"{width}x{height}"


def _vision(t: Translation, sample: dict[str, Any], limits: ModelLimits) -> None:
    image = t.mode == "text2image"
    if image and sample.get("fps") is not None:
        t.refuse("fps", "an image has no frame rate (text2image)")
    _frames(t, sample, table.DEFAULTS["text2image" if image else "video"].num_frames, limits)
    if image:
        t.obj.pop("num_frames", None)
        t.obj["num_frames"] = 1
    _size(t, sample, limits, image)
    path = sample.get("vision_path")
    if t.mode == "image2video":
        t.obj["image"] = path
        frames = sample.get("condition_frame_indexes_vision")
        if frames is not None and frames != [0]:
            t.refuse("condition_frame_indexes_vision", "an image condition is latent frame [0] in diffusers")
    elif t.mode == "video2video":
        t.obj["video"] = path
        if sample.get("condition_frame_indexes_vision") is not None:
            t.obj["condition_frames"] = sample["condition_frame_indexes_vision"]
        if sample.get("condition_video_keep") is not None:
            t.obj["condition_video_keep"] = sample["condition_video_keep"]
    for key in ("condition_frame_indexes_vision", "condition_video_keep"):
        if sample.get(key) is not None and t.mode in ("text2image", "text2video"):
            t.refuse(key, f"is only used with a vision_path ({t.mode} has none)")


def _action(t: Translation, sample: dict[str, Any]) -> None:
    for key in ("resolution", "aspect_ratio", "num_frames", "condition_frame_indexes_vision"):
        if sample.get(key) is not None:
            t.refuse(key, "an action sample's canvas and frames come from image_size and action_chunk_size")
    path = sample.get("vision_path")
    if path is None:
        t.refuse("vision_path", f"missing: model_mode {t.mode} needs an observation image or video")
    elif isinstance(path, str):
        t.obj["video" if path.lower().endswith(table.VIDEO_SUFFIXES) else "image"] = path
    action: dict[str, Any] = {"mode": t.mode}
    for theirs, ours, default in (
        ("action_chunk_size", "chunk_size", 16),
        ("domain_name", "domain", None),
        ("image_size", "resolution_tier", 256),
        ("view_point", "viewpoint", "ego_view"),
        ("action_path", "actions", None),
    ):
        value = sample.get(theirs, default)
        if value is not None:
            action[ours] = value
            if theirs not in sample:
                t.defaults.append(theirs)
    t.obj["action"] = action
    width = sample.get("raw_action_dim")
    if width is not None:
        from cosmos3_batch.requests.actions import DOMAIN_WIDTHS

        if DOMAIN_WIDTHS.get(action.get("domain")) != width:
            known = DOMAIN_WIDTHS.get(action.get("domain"))
            t.refuse("raw_action_dim", f"{describe(width)} is not domain_name's action width ({known})")


_OWN_ASPECT = (
    "required for a Transfer sample here: NVIDIA's CLI takes the input's own aspect ratio "
    "(cosmos_framework/inference/vision.py), which this tool does not reproduce"
)
_NO_DIRECTIVE = (
    "NVIDIA's CLI appends a control directive to the prompt unless emphasize_control_in_prompt is false; "
    "diffusers' pipeline has none, so this request runs the prompt as written"
)


def _transfer(t: Translation, sample: dict[str, Any], hints: list[str], limits: ModelLimits) -> None:
    """Hints -> `control` (a hint without control_path is derived from vision_path, as NVIDIA derives it)."""
    t.obj["control"] = {hint: sample[hint].get("control_path") or "auto" for hint in hints}
    path = sample.get("vision_path")
    if isinstance(path, str):
        t.obj["video"] = path
    if sample.get("aspect_ratio") is None:
        t.refuse("aspect_ratio", _OWN_ASPECT)
    else:
        _size(t, sample, limits, False)
    single = table.TRANSFER_DEFAULTS[hints[0]] if len(hints) == 1 else {}
    _frames(t, sample, single.get("num_frames"), limits)
    if sample.get("fps") is None and "fps" in single:
        t.obj["fps"] = single["fps"]
        t.defaults.append("fps")
    for theirs, ours in (
        ("control_guidance", "control_guidance"),
        ("control_guidance_interval", "control_guidance_interval"),
        ("num_video_frames_per_chunk", "frames_per_chunk"),
        ("num_conditional_frames", "conditional_frames"),
        ("num_first_chunk_conditional_frames", "first_chunk_conditional_frames"),
    ):
        value = sample.get(theirs)
        if value is None:
            value = single.get(theirs, table.TRANSFER_SAMPLE_DEFAULTS.get(theirs))
            if value is not None:
                t.defaults.append(theirs)
        if value is not None:
            t.obj[ours] = value
    if sample.get("emphasize_control_in_prompt") is None:
        t.notes.append(_NO_DIRECTIVE)


def _sampling(t: Translation, sample: dict[str, Any], hints: list[str], limits: ModelLimits) -> None:
    """num_steps, guidance, shift (and a video's fps) from the sample, else NVIDIA's default for its mode."""
    kind = "text2image" if t.mode == "text2image" else "action" if t.mode in table.ACTION_MODES else "video"
    mode = table.DEFAULTS[kind]
    defaults: dict[str, Any] = {"num_steps": mode.steps, "guidance": mode.guidance, "shift": mode.shift}
    if len(hints) == 1:
        defaults.update({k: v for k, v in table.TRANSFER_DEFAULTS[hints[0]].items() if k in defaults})
    for theirs, ours in (
        ("num_steps", "num_inference_steps"),
        ("guidance", "guidance_scale"),
        ("shift", "flow_shift"),
    ):
        if sample.get(theirs) is not None:
            t.obj[ours] = sample[theirs]
        elif not limits.defaults.distilled and defaults[theirs] is not None:  # distilled: the checkpoint's
            t.obj[ours] = defaults[theirs]
            t.defaults.append(theirs)
    if kind == "video" and "fps" not in t.obj and mode.fps is not None:
        t.obj["fps"] = mode.fps
        t.defaults.append("fps")
