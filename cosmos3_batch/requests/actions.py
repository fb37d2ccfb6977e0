"""Checks of the `action` object (DESIGN.md §9): forward dynamics, inverse dynamics and policy requests.

Imports no torch, so the tables the reference keeps in `pipeline_cosmos3_omni` are mirrored here as data;
tests/unit/test_request_actions.py holds them equal to the installed diffusers' tables.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from cosmos3_batch.requests.fields import _ABSENT, LineErrors, ModelLimits, _get, _show, describe

MODES = ("forward_dynamics", "inverse_dynamics", "policy")
# Tier -> {aspect ratio (height / width) -> (height, width)}: the canvases the action model was trained on.
RESOLUTION_BINS = {
    256: {
        1.0: (256, 256), 0.8: (256, 320), 1.25: (320, 256), 0.6: (192, 320), 1.6666666666666667: (320, 192),
    },
    480: {
        1.0: (640, 640), 0.7391304347826086: (544, 736), 1.3529411764705883: (736, 544),
        0.5769230769230769: (480, 832), 1.7333333333333334: (832, 480),
    },
    704: {
        1.0: (960, 960), 0.7647058823529411: (832, 1088), 1.3076923076923077: (1088, 832),
        0.55: (704, 1280), 1.8181818181818181: (1280, 704),
    },
    720: {
        1.0: (960, 960), 0.7536231884057971: (832, 1104), 1.3269230769230769: (1104, 832),
        0.5625: (720, 1280), 1.7777777777777777: (1280, 720),
    },
}  # fmt: skip
# Embodiment -> unpadded action width. Only domains with a fixed width can run (the reference rejects others).
DOMAIN_WIDTHS = {
    "av": 9, "camera_pose": 9, "pusht": 2, "umi": 10, "bridge_orig_lerobot": 10, "droid_lerobot": 10,
    "robomind-franka": 10, "robomind-franka-dual": 20, "robomind-ur": 10, "galbot": 30, "agibotworld": 29,
    "agibot_gear_gripper": 29, "agibot_gear_gripper_ext": 29, "fractal": 10, "hand_pose": 57,
}  # fmt: skip
VIEWPOINTS = ("ego_view", "third_person_view", "wrist_view", "concat_view")
ACTION_KEYS = ("mode", "chunk_size", "domain", "resolution_tier", "viewpoint", "actions")
# Top-level keys an action request may not carry: its size and frame count come from the tier and chunk.
EXCLUDED = ("size", "width", "height", "num_frames", "condition_frames", "condition_video_keep")
MAX_ACTION_ROWS = 100_000


@dataclass(frozen=True)
class ActionSpec:
    mode: str
    chunk_size: int  # action transitions; the clip spans chunk_size + 1 frames
    domain: str
    resolution_tier: int
    viewpoint: str
    # forward_dynamics only: an absolute .npy/.json path, or the rows themselves (inline in the JSONL)
    actions: str | tuple[tuple[float, ...], ...] | None = None

    @property
    def width(self) -> int:
        return DOMAIN_WIDTHS[self.domain]


def has_action(obj: dict[str, Any]) -> bool:
    return _get(obj, "action") is not _ABSENT


def canvas(tier: int, height: int, width: int, factor: int) -> tuple[int, int]:
    """The reference's canvas for a conditioning frame: its size rounded down to the VAE factor (what
    `preprocess_video` does), then the tier's bin closest in aspect ratio (`classify_height_width_bin`)."""
    h, w = height - height % factor, width - width % factor
    ratio = min(RESOLUTION_BINS[tier], key=lambda r: abs(r - h / w))
    return RESOLUTION_BINS[tier][ratio]


def check_action(
    out: LineErrors, obj: dict[str, Any], base_dir: str | None, limits: ModelLimits
) -> ActionSpec | None:
    value = _get(obj, "action")
    if not isinstance(value, dict):
        out.add("action", f"must be an object with {', '.join(ACTION_KEYS)}, got {describe(value)}")
        return None
    for key in EXCLUDED:
        if _get(obj, key) is not _ABSENT:
            out.add(key, "set by action (tier and chunk_size): remove it from action requests")
    if limits.action is False:
        out.add("action", "this checkpoint cannot run action modes: its transformer has no action_gen")
    for key in getattr(value, "duplicates", ()):
        out.add(f"action.{key}", "key appears more than once in this object")
    for key in sorted(set(value) - set(ACTION_KEYS)):
        out.add(f"action.{key}", f"unknown key; allowed: {', '.join(ACTION_KEYS)}")
    fields = {
        "mode": _choice(out, value, "mode", MODES, None),
        "chunk_size": _chunk_size(out, value, limits),
        "domain": _domain(out, value, limits),
        "resolution_tier": _choice(out, value, "resolution_tier", tuple(RESOLUTION_BINS), 480),
        "viewpoint": _choice(out, value, "viewpoint", VIEWPOINTS, "ego_view"),
    }
    fields["actions"] = _actions(out, value, base_dir, fields["mode"], fields["domain"])
    if any(v is None for k, v in fields.items() if k != "actions"):
        return None
    return ActionSpec(**fields)


def _choice(out: LineErrors, value: dict, key: str, allowed: tuple, default: Any) -> Any:
    got = _get(value, key)
    if got is _ABSENT:
        if default is None:
            out.add(f"action.{key}", f"missing: one of {', '.join(map(str, allowed))}")
        return default
    if isinstance(got, bool) or got not in allowed:
        out.add(f"action.{key}", f"must be one of {', '.join(map(str, allowed))}, got {describe(got)}")
        return None
    return got


def _chunk_size(out: LineErrors, value: dict, limits: ModelLimits) -> int | None:
    got, step = _get(value, "chunk_size"), limits.temporal_factor
    if got is _ABSENT:
        out.add("action.chunk_size", "missing: the number of action steps (a multiple of 4, e.g. 16)")
    elif isinstance(got, bool) or not isinstance(got, int):
        out.add("action.chunk_size", f"must be an integer, got {describe(got)}")
    elif not step <= got <= limits.max_frames - 1:
        out.add("action.chunk_size", f"must be >= {step} and <= {limits.max_frames - 1}, got {got}")
    elif got % step:
        # The clip spans chunk_size + 1 frames, which the VAE represents only as 4k + 1.
        lower = got // step * step
        out.add(
            "action.chunk_size",
            f"{got} is not a multiple of {step} (nearest valid: {lower} or {lower + step})",
        )
    else:
        return got
    return None


def _domain(out: LineErrors, value: dict, limits: ModelLimits) -> str | None:
    got = _get(value, "domain")
    valid = ", ".join(sorted(DOMAIN_WIDTHS))
    if got is _ABSENT:
        out.add("action.domain", f"missing: the embodiment, one of {valid}")
    elif not isinstance(got, str) or got not in DOMAIN_WIDTHS:
        shown = _show(got) if isinstance(got, str) else describe(got)
        out.add("action.domain", f"unknown domain {shown}; valid domains: {valid}")
    elif limits.action_dim is not None and DOMAIN_WIDTHS[got] > limits.action_dim:
        out.add(
            "action.domain",
            f"{got} actions are {DOMAIN_WIDTHS[got]} wide, over the model's {limits.action_dim}",
        )
    else:
        return got
    return None


def _actions(out: LineErrors, value: dict, base_dir: str | None, mode: str | None, domain: str | None):
    got = _get(value, "actions")
    if mode is not None and mode != "forward_dynamics":
        if got is not _ABSENT:
            out.add("action.actions", f"only forward_dynamics takes actions; {mode} predicts them")
        return None
    if got is _ABSENT:
        if mode is not None:
            out.add(
                "action.actions", "forward_dynamics needs actions: a .npy/.json [T, D] file or a list of rows"
            )
        return None
    if isinstance(got, str):
        path = os.path.abspath(os.path.join(base_dir if base_dir is not None else os.getcwd(), got))
        rows, problem = _read_actions_file(path)
        result: Any = path
    else:
        rows, problem, result = got, None, None
    array = None if problem else _as_rows(rows)
    if array is None:
        out.add(
            "action.actions", problem or f"must be a [T, D] list of lists of numbers, got {describe(got)}"
        )
        return None
    width = DOMAIN_WIDTHS.get(domain) if domain is not None else None
    if (problem := _row_problem(array, width, domain)) is not None:
        out.add("action.actions", problem)
        return None
    return result if result is not None else tuple(tuple(float(x) for x in row) for row in array.tolist())


def _read_actions_file(path: str) -> tuple[Any, str | None]:
    if not os.path.isfile(path):
        return None, f"actions file not found: {path}"
    try:
        if path.endswith(".npy"):
            array = np.load(path, allow_pickle=False)
            if array.dtype.kind not in "fiu":
                return None, f"{path}: dtype {array.dtype} is not a real number type"
            return array, None
        if path.endswith(".json"):
            with open(path, encoding="utf-8") as f:
                return json.load(f), None
    except (OSError, ValueError) as exc:  # truncated .npy, bad JSON, pickled objects
        return None, f"{path} is not a readable actions file ({type(exc).__name__}: {_show(str(exc))})"
    return None, f"{path}: actions files must be .npy or .json"


def _as_rows(rows: Any) -> np.ndarray | None:
    if isinstance(rows, np.ndarray):
        return rows.astype(np.float64)
    ok = isinstance(rows, list) and all(isinstance(r, list) for r in rows)
    if not ok or not all(isinstance(x, int | float) and not isinstance(x, bool) for r in rows for x in r):
        return None
    if len({len(r) for r in rows}) > 1:
        return None
    return np.asarray(rows, dtype=np.float64)


def _row_problem(array: np.ndarray, width: int | None, domain: str | None) -> str | None:
    if array.ndim != 2 or array.shape[0] < 1:
        return f"must have shape [T, D] with T >= 1, got shape {list(array.shape)}"
    if array.shape[0] > MAX_ACTION_ROWS:
        return f"{array.shape[0]} rows exceed the maximum of {MAX_ACTION_ROWS}"
    if not np.isfinite(array).all():
        return "contains NaN or infinity"
    if width is not None and array.shape[1] != width:
        return f"rows are {array.shape[1]} wide; {domain} actions are {width} wide"
    if math.prod(array.shape) == 0:
        return "is empty"
    return None


def check_action_request(
    out: LineErrors, obj: dict[str, Any], base_dir: str | None, limits: ModelLimits
) -> tuple[dict[str, Any], int | None]:
    """The Request fields of an action line, and its frame count (chunk_size + 1)."""
    from cosmos3_batch.requests.fields import check_image
    from cosmos3_batch.requests.modes import check_sound, check_video_path

    spec = check_action(out, obj, base_dir, limits)
    num_frames = spec.chunk_size + 1 if spec is not None else None
    values: dict[str, Any] = {"action": spec, "condition_frames": None, "condition_video_keep": None}
    values["sound"] = check_sound(out, obj, limits, num_frames)
    image_given, video_given = _get(obj, "image") is not _ABSENT, _get(obj, "video") is not _ABSENT
    values["image"] = check_image(out, obj, base_dir, num_frames) if image_given else None
    values["video"] = check_video_path(out, _get(obj, "video"), base_dir) if video_given else None
    if image_given and video_given:
        out.add("video", "give the action's conditioning as image or video, not both")
    elif not image_given and not video_given:
        out.add("action", "needs a conditioning image or video (top-level image or video field)")
    elif spec is not None and spec.mode == "inverse_dynamics" and not video_given:
        out.add("image", "inverse_dynamics infers the actions between frames: it needs a video, not an image")
    source = values["image"] or values["video"]
    if spec is not None and source is not None and not out.errors:
        size = _source_size(out, "image" if image_given else "video", source, limits.spatial_factor)
        if size is not None:
            values["height"], values["width"] = canvas(spec.resolution_tier, *size, limits.spatial_factor)
    return values, num_frames


def _source_size(out: LineErrors, key: str, path: str, factor: int) -> tuple[int, int] | None:
    """(height, width) of the conditioning frame, after checking it is RGB and at least one VAE cell."""
    try:
        if key == "video" and not path.endswith(".gif"):
            import imageio

            with imageio.get_reader(path) as reader:
                width, height = reader.get_meta_data()["size"]
                mode = "RGB"  # imageio's ffmpeg reader decodes to rgb24
        else:
            from PIL import Image

            with Image.open(path) as image:
                (width, height), mode = image.size, image.mode
    except Exception as exc:  # already read once by the field check; a file replaced since then
        out.add(key, f"{path} is not readable ({type(exc).__name__})")
        return None
    if mode != "RGB":
        # The action path hands frames to the pipeline's preprocess_video as they are; it needs RGB.
        out.add(key, f"{path} has {mode!r} pixels; action conditioning needs RGB (convert it)")
    elif height < factor or width < factor:
        out.add(key, f"{path} is {width}x{height}, smaller than one {factor}x{factor} latent cell")
    else:
        return height, width
    return None


def load_actions(spec: ActionSpec) -> np.ndarray:
    """The forward-dynamics actions [T, D] as validated: a .npy keeps its dtype, JSON numbers are float64."""
    if isinstance(spec.actions, str):
        if spec.actions.endswith(".npy"):
            return np.load(spec.actions, allow_pickle=False)
        with open(spec.actions, encoding="utf-8") as f:
            return np.asarray(json.load(f), dtype=np.float64)
    return np.asarray(spec.actions, dtype=np.float64)
