"""Transfer request fields (DESIGN.md §17): `control` and the fields that go with it, checked up front.

A Transfer line renders a video that follows control maps, as `Cosmos3OmniModularPipeline` does when called
with `control_videos={hint: frames}`. Its geometry is the reference's `Cosmos3TransferSetupStep`: the output
frame count is the first control's (in the canonical hint order), capped by `num_frames`; chunks of
`frames_per_chunk` frames (4k+1; default: all frames in one chunk) overlap by `conditional_frames`. What the
reference would silently do differently from what was asked is an error here instead: a cap longer than the
controls, a control shorter than the frames it must cover. Like the other checks: report into `LineErrors`,
return what could be read, no torch (the controls are probed with imageio and PIL).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from cosmos3_batch.requests.fields import (
    _ABSENT,
    LineErrors,
    ModelLimits,
    _get,
    _number,
    check_size,
    describe,
)
from cosmos3_batch.requests.modes import count_frames, resolve_path

HINTS = ("edge", "blur", "depth", "seg", "wsm")  # the reference's canonical order (its hint_order)
DERIVED = {"edge": "Canny edges", "blur": "a bilateral-filtered blur"}  # "auto": computed from `video`
# NVIDIA's Transfer inference presets ("medium", its CLI's default) for the derived controls, as
# pipeline/kinds/transfer/controls.py applies them and the sidecar records them: cosmos-transfer2.5's
# AddControlInputEdge (Canny thresholds) and AddControlInputBlur (its bilateral filter config and down/up
# factors).
DERIVED_PARAMS = {
    "edge": {"operator": "cv2.Canny", "preset": "medium", "threshold1": 100, "threshold2": 200},
    "blur": {"operator": "cv2.bilateralFilter", "preset": "medium", "downsize": 2, "d": 30,
             "sigma_color": 150, "sigma_space": 100, "iterations": 1, "down_up": 10},
}  # fmt: skip
AUTO = "auto"
TRANSFER_KEYS = (
    "control_guidance", "guidance_interval", "control_guidance_interval", "frames_per_chunk",
    "conditional_frames", "first_chunk_conditional_frames",
)  # fmt: skip
# Fields the reference's Transfer path does not take (its blocks skip the image/V2V/action/sound steps).
EXCLUDED = ("image", "action", "sound", "condition_frames", "condition_video_keep", "max_sequence_length")
DEFAULT_CONTROL_GUIDANCE = 1.0  # Cosmos3TransferLoopDenoiser's control_guidance default
DEFAULT_CONDITIONAL_FRAMES = 1  # Cosmos3TransferSetupStep's num_conditional_frames default
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")  # a still image: a one-frame control


@dataclass(frozen=True, slots=True)
class TransferSpec:
    """A Transfer request's controls and chunking, resolved. Paths are absolute; `AUTO` = derived."""

    controls: tuple[tuple[str, str], ...]  # (hint, path or "auto"), in the canonical hint order
    control_frames: tuple[int, ...]  # each control's frame count as found (a derived one: the video's)
    control_guidance: float
    guidance_interval: tuple[float, float] | None  # timesteps [lo, hi] where text guidance is on; None: all
    control_guidance_interval: tuple[float, float] | None
    chunk_frames: int  # pixel frames per chunk, 4k+1
    num_chunks: int
    stride: int  # frames between chunk starts
    conditional_frames: int  # frames each later chunk takes from the previous chunk's decoded tail
    video: str | None = None  # seeds the first chunk; the source of derived controls
    first_chunk_conditional_frames: int = 0

    @property
    def hints(self) -> tuple[str, ...]:
        return tuple(hint for hint, _ in self.controls)


def has_transfer(obj: dict[str, Any]) -> bool:
    return _get(obj, "control") is not _ABSENT


def stray_fields(out: LineErrors, obj: dict[str, Any]) -> None:
    """Transfer's fields on a line without `control`."""
    for key in TRANSFER_KEYS:
        if _get(obj, key) is not _ABSENT:
            out.add(key, "is only used with control (Transfer); add a control or remove it")


def chunking(total: int, per_chunk: int | None, conditional: int, temporal: int) -> tuple[int, int, int]:
    """(chunk_frames, num_chunks, stride) exactly as Cosmos3TransferSetupStep resolves them."""
    chunk = 1 if total == 1 else (per_chunk if per_chunk is not None else total)
    chunk = math.ceil((chunk - 1) / temporal) * temporal + 1
    if total <= chunk:
        return chunk, 1, chunk
    stride = chunk - conditional
    if stride <= 0:  # the reference raises here; request checks report it first
        raise ValueError(f"conditional_frames {conditional} must be smaller than a chunk ({chunk} frames)")
    remaining = total - chunk
    return chunk, 1 + remaining // stride + (1 if remaining % stride else 0), stride


def check_transfer_request(
    out: LineErrors, obj: dict[str, Any], base_dir: str | None, limits: ModelLimits
) -> tuple[dict[str, Any], int | None]:
    """The Request fields of a Transfer line, and its output frame count."""
    from cosmos3_batch.requests.modes import check_video_path

    for key in EXCLUDED:
        if _get(obj, key) is not _ABSENT:
            out.add(key, "not used by Transfer (control): remove it from this request")
    if limits.defaults.distilled:
        out.add("control", "a distilled checkpoint cannot run Transfer (its blocks have no control path)")
    video, has_video = None, _get(obj, "video") is not _ABSENT
    if has_video:
        video = check_video_path(out, _get(obj, "video"), base_dir)
    video_frames = count_frames(video)[0] if video is not None else None
    controls = _check_controls(out, _get(obj, "control"), base_dir, (has_video, video_frames))
    values: dict[str, Any] = {"transfer": None, "video": None, "image": None, "sound": False}
    values.update(check_size(out, obj, limits, None))  # never the image default: the reference's 1280x720
    total = _total_frames(out, obj, controls, limits)
    spec = _spec(out, obj, controls, total, (video, video_frames, has_video), limits)
    if spec is not None and not out.errors and "width" in values:
        _check_tokens(out, limits, values["width"], values["height"], spec)
    values["transfer"] = spec
    return values, total


def _check_controls(
    out: LineErrors, value: Any, base_dir: str | None, video: tuple[bool, int | None]
) -> list[tuple[str, str, int]]:
    """(hint, path or "auto", frames) per good control, in the canonical order; `video`: (given, its frames
    when readable), the source of derived controls."""
    if not isinstance(value, dict) or not value:
        got = "an empty object" if value == {} else describe(value)
        out.add("control", f"must map at least one hint ({', '.join(HINTS)}) to a control video, got {got}")
        return []
    for key in getattr(value, "duplicates", ()):
        out.add(f"control.{key}", "key appears more than once in this object")
    unknown = [key for key in value if key not in HINTS]
    for key in unknown:
        out.add(f"control.{key}", f"unknown hint; the hints are {', '.join(HINTS)}")
    found = []
    for hint in (h for h in HINTS if h in value):
        field, path = f"control.{hint}", value[hint]
        if path == AUTO:
            derived = _derived(out, field, hint, video)
            if derived is not None:
                found.append((hint, AUTO, derived))
            continue
        if not isinstance(path, str) or not path:
            out.add(field, f'must be a path to a control video or image (or "auto"), got {describe(path)}')
            continue
        resolved = resolve_path(base_dir, path)
        frames, problem = _probe_control(resolved)
        if problem is not None:
            out.add(field, f"{resolved} {problem}")
        else:
            found.append((hint, resolved, frames))
    return found


def _derived(out: LineErrors, field: str, hint: str, video: tuple[bool, int | None]) -> int | None:
    """The frames of an "auto" control (the video's), or None with the reason reported."""
    given, frames = video
    if hint not in DERIVED:
        out.add(field, f'"auto" needs a {hint} model, which this tool does not run: give the {hint} control '
                "as a video file (only edge and blur are derived from the video)")  # fmt: skip
    elif not given:
        out.add(field, f'"auto" derives {DERIVED[hint]} from the request\'s video: add a video')
    return frames if hint in DERIVED and given else None


def _probe_control(path: str) -> tuple[int | None, str | None]:
    """(frames, None) or (None, why not): a still image is one frame, decoded whole as a video is."""
    if not path.lower().endswith(IMAGE_SUFFIXES):
        return count_frames(path)
    from PIL import Image

    try:
        with Image.open(path) as image:
            image.load()
    except FileNotFoundError:
        return None, "not found"
    except Exception as exc:  # PIL reports bad files with many exception types
        return None, f"is not a readable image ({type(exc).__name__}: {exc})"
    return 1, None


def _total_frames(
    out: LineErrors, obj: dict[str, Any], controls: list[tuple[str, str, int]], limits: ModelLimits
) -> int | None:
    """The first control's length capped by `num_frames`; every control must cover it (a one-frame control,
    a still image, is repeated as the reference repeats it)."""
    cap = _get(obj, "num_frames")
    if cap is not _ABSENT:
        cap = _number(out, "num_frames", cap, integer=True)
        if cap is not None and not 1 <= cap <= limits.max_frames:
            out.add("num_frames", f"must be >= 1 and <= {limits.max_frames}, got {cap}")
            return None
    if not controls or cap is None:
        return None
    total = controls[0][2] if cap is _ABSENT else cap
    for hint, _, frames in controls:
        if 1 < frames < total:
            which = "num_frames" if cap is not _ABSENT else f"control.{hint}"
            out.add(which, f"{total} frames asked, but the {hint} control has only {frames} frames")
    return None if out.errors else total


def _spec(
    out: LineErrors,
    obj: dict[str, Any],
    controls: list[tuple[str, str, int]],
    total: int | None,
    seed: tuple[str | None, int | None, bool],
    limits: ModelLimits,
) -> TransferSpec | None:
    video, video_frames, has_video = seed
    guidance = _bounded(out, obj, "control_guidance", DEFAULT_CONTROL_GUIDANCE, integer=False, high=100)
    intervals = [_interval(out, obj, key) for key in ("guidance_interval", "control_guidance_interval")]
    per_chunk = _bounded(out, obj, "frames_per_chunk", None, integer=True, high=limits.max_frames, low=1)
    step = limits.temporal_factor
    if per_chunk is not None and (per_chunk - 1) % step:
        lower = (per_chunk - 1) // step * step + 1
        out.add("frames_per_chunk", f"{per_chunk} cannot be represented: use {lower} or {lower + step} "
                f"(chunk frame counts are {step}k+1)")  # fmt: skip
    most = limits.max_frames
    conditional = _bounded(out, obj, "conditional_frames", DEFAULT_CONDITIONAL_FRAMES, True, most)
    first = _bounded(out, obj, "first_chunk_conditional_frames", 0, True, limits.max_frames)
    if _get(obj, "first_chunk_conditional_frames") is not _ABSENT and not has_video:
        out.add("first_chunk_conditional_frames", "seeds the first chunk from video: add a video")
    if out.errors or total is None:
        return None
    try:
        chunk, chunks, stride = chunking(total, per_chunk, conditional, step)
    except ValueError as exc:
        out.add("conditional_frames", f"{exc}: each chunk must make at least one new frame")
        return None
    if first >= chunk:
        out.add("first_chunk_conditional_frames", f"{first} must be smaller than a chunk ({chunk} frames)")
    elif video_frames is not None and first > video_frames:
        out.add("first_chunk_conditional_frames", f"{first} frames asked, the video has {video_frames}")
    if out.errors:
        return None
    return TransferSpec(
        controls=tuple((hint, path) for hint, path, _ in controls),
        control_frames=tuple(frames for _, _, frames in controls),
        control_guidance=guidance,
        guidance_interval=intervals[0],
        control_guidance_interval=intervals[1],
        chunk_frames=chunk,
        num_chunks=chunks,
        stride=stride,
        conditional_frames=conditional,
        video=video,
        first_chunk_conditional_frames=first,
    )


def _bounded(
    out: LineErrors, obj: dict[str, Any], key: str, default: Any, integer: bool, high: float, low: float = 0
) -> Any:
    raw = _get(obj, key)
    if raw is _ABSENT:
        return default
    value = _number(out, key, raw, integer)
    if value is not None and not low <= value <= high:
        out.add(key, f"must be >= {low} and <= {high}, got {describe(value)}")
    return value


def _interval(out: LineErrors, obj: dict[str, Any], key: str) -> tuple[float, float] | None:
    """`[lo, hi]` in timesteps (the scheduler's, 0..1000); absent: always on."""
    raw = _get(obj, key)
    if raw is _ABSENT:
        return None
    ok = isinstance(raw, list) and len(raw) == 2
    ok = ok and all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in raw)
    if not ok:
        out.add(key, f"must be [lo, hi] in timesteps, e.g. [0, 500], got {describe(raw)}")
        return None
    if raw[0] > raw[1]:
        out.add(key, f"lo {raw[0]} is above hi {raw[1]}")
        return None
    return float(raw[0]), float(raw[1])


def _check_tokens(out: LineErrors, limits: ModelLimits, width: int, height: int, spec: TransferSpec) -> None:
    """A chunk's longest sequence carries every control besides the target: the bound counts them."""
    latent_t = (spec.chunk_frames - 1) // limits.temporal_factor + 1
    cells = -(-height // (limits.spatial_factor * 2)) * -(-width // (limits.spatial_factor * 2))
    tokens = (len(spec.controls) + 1) * latent_t * cells
    if tokens > limits.max_vision_tokens:
        out.add(
            "control",
            f"{width}x{height} x {spec.chunk_frames} frames per chunk with {len(spec.controls)} control(s) "
            f"is {tokens:,} vision tokens, over the per-request bound of {limits.max_vision_tokens:,} "
            "(use a smaller frames_per_chunk, or raise --max-vision-tokens if the GPUs allow)",
        )
