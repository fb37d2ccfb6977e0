"""Field-by-field checks of one request line (DESIGN.md §6), apart from requests/parse.py so both stay small.

Each check reports into a `LineErrors` and returns what it could read, so one bad field never hides
another: a user fixes the whole file in one edit. No torch here either.
"""

import difflib
import math
import os
import re
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any

from PIL import Image

from cosmos3_batch.requests.defaults import COSMOS3, RequestDefaults
from cosmos3_batch.requests.guardrail_field import guardrails_mismatch

# Defaults follow the Cosmos3 model card.
DEFAULT_GUIDANCE = COSMOS3.guidance  # Nano's and Super's; other checkpoints' rows: requests/defaults.py
DEFAULT_FPS = COSMOS3.fps
MAX_SEED = 2**63 - 1

ALLOWED_KEYS = (
    "id", "prompt", "negative_prompt", "size", "width", "height", "num_frames", "fps",
    "num_inference_steps", "guidance_scale", "seed", "max_sequence_length", "flow_shift", "image",
    "extra_params", "video", "condition_frames", "condition_video_keep", "system_prompt", "sound",
    "action", "samples", "control", "control_guidance", "guidance_interval", "control_guidance_interval",
    "frames_per_chunk", "conditional_frames", "first_chunk_conditional_frames", "reason", "upsample",
    "caption_instruction", "score_instruction",
)  # fmt: skip
# `"samples": N` fans one request out into N (DESIGN.md §13); bounded so a typo cannot queue a million.
MAX_SAMPLES = 10_000
# The prompt templates default to on, as in the reference pipeline: the model was trained with them.
EXTRA_PARAMS_DEFAULTS = {"use_resolution_template": True, "use_duration_template": True, "guardrails": False}
# `<id>.json` is the sidecar: id "summary" would overwrite summary.json (case-insensitive, as macOS's FS is).
RESERVED_IDS = frozenset({"summary"})

_ID_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")
# Nine digits at most: anything longer is far past max_side, and int() on a huge digit string is slow.
_SIZE_RE = re.compile(r"([0-9]{1,9})x([0-9]{1,9})")


@dataclass(frozen=True)
class ModelLimits:
    """What the VAE/patching can represent, and sanity bounds; the model layer may pass its own."""

    spatial_factor: int = 16  # pixels per latent cell (VAE compression x patch); width/height multiples
    temporal_factor: int = 4  # video frame counts must be temporal_factor*k + 1
    max_side: int = 4096  # bound on width and height
    max_frames: int = 1024  # bound on num_frames
    max_steps: int = 1000  # bound on num_inference_steps
    # Vision tokens of one request (latent frames x latent cells / patch^2), so that one request cannot
    # exhaust a GPU: 1280x720 at 189 frames is 44,160; the default leaves room for 1080p at 121 frames.
    max_vision_tokens: int = 65536
    # What the checkpoint can generate besides vision (model/limits.py reads it from the checkpoint via
    # `requests/modes.py checkpoint_modes`); None = not known here, so not checked.
    sound: bool | None = None
    action: bool | None = None  # action_gen
    action_dim: int | None = None  # the widest action the checkpoint represents
    # The reasoner's parts the checkpoint lacks (model/reasoner_files.py names them); None = not known here.
    reasoner_missing: tuple[str, ...] | None = None
    # The reference's defaults for this checkpoint (requests/defaults.py); distilled ones fix steps, guidance.
    defaults: RequestDefaults = COSMOS3
    # Whether this job runs NVIDIA's guardrails (--guardrails / --no-guardrails, docs/guardrails.md): a job
    # setting, which a request's `extra_params.guardrails` may only restate.
    guardrails: bool = False
    chain: Any = None  # requests/chain.py ChainDefaults: the job's --upsample / --caption (None: off)


DEFAULT_LIMITS = ModelLimits()  # a module constant rather than a call in every signature (ruff B008)


@dataclass(frozen=True)
class RequestError:
    line: int  # 0 for file-level problems; else the place its `unit` counts
    field: str | None  # the JSON key at fault; None for whole-line problems
    message: str
    # Where, not what: equality is line, field and message. `source`: the file ("<stdin>"; "" when the
    # caller names it); `unit`: what `line` counts there (line, item of a JSON array, row of Parquet).
    source: str = dataclass_field(default="", compare=False)
    unit: str = dataclass_field(default="line", compare=False)

    def __str__(self) -> str:
        where = [f"{self.unit} {self.line}"] if self.line else []
        if self.field is not None:
            where.append(f"field {_show(self.field)}")
        return f"{', '.join(where)}: {self.message}" if where else self.message


@dataclass(frozen=True)
class NonFinite:
    """What NaN/Infinity/-Infinity decode to: no check accepts it, so the error names the key holding it."""

    name: str


class JsonObject(dict):
    """A decoded JSON object that remembers the keys json.loads would otherwise keep only once."""

    duplicates: tuple[str, ...] = ()


class LineErrors:
    """Collects one line's problems so each check can report and the next one still runs."""

    def __init__(self, line: int) -> None:
        self.line = line
        self.errors: list[RequestError] = []

    def add(self, field: str | None, message: str) -> None:
        self.errors.append(RequestError(self.line, field, message))


_ABSENT: Any = object()


def _get(obj: dict[str, Any], key: str) -> Any:
    """The value of an optional key; JSON null means "use the default", the same as leaving it out."""
    value = obj.get(key)
    return _ABSENT if value is None else value


def check_keys(out: LineErrors, obj: JsonObject) -> None:
    for key in obj.duplicates:
        out.add(key, "key appears more than once in this object")
    unknown = sorted(key for key in obj if key not in ALLOWED_KEYS)
    if not unknown:
        return
    names = ", ".join(_show(key) for key in unknown)
    columns = _column_hints(obj, unknown)
    close = {key: difflib.get_close_matches(key, ALLOWED_KEYS, n=1) for key in unknown if key not in columns}
    hints = [f"{_show(key)} -> {match[0]!r}" for key, match in close.items() if match]
    hint = f" (did you mean {', '.join(hints)}?)" if hints else ""
    hint += f" ({'; '.join(columns.values())})" if columns else ""
    plural = "s" if len(unknown) > 1 else ""
    out.add(unknown[0], f"unknown key{plural} {names}{hint}; allowed keys: {', '.join(ALLOWED_KEYS)}")


# Common names of a dataset's prompt and id columns: `--prompt-column` / `--id-column` read them as such.
PROMPT_LIKE = ("caption", "text", "description", "instruction", "prompt_text", "captions", "sentence")
ID_LIKE = ("key", "uid", "uuid", "name", "__key__", "sample_id", "video_id", "image_id", "idx")


def _column_hints(obj: JsonObject, unknown: list[str]) -> dict[str, str]:
    """Unknown key -> the flag that reads it as the prompt or the id (only while that field is absent)."""
    hints = {}
    for target, names in (("prompt", PROMPT_LIKE), ("id", ID_LIKE)):
        found = [key for key in unknown if isinstance(key, str) and key.lower() in names]
        if found and target not in obj:
            key = found[0]
            hints[key] = f"{_show(key)} holds the {target}? pass --{target}-column {key}"
    return hints


def check_id(out: LineErrors, obj: JsonObject, line: int) -> str | None:
    value = _get(obj, "id")
    if value is _ABSENT:
        return f"line{line:06d}"
    if not isinstance(value, str):
        out.add("id", f"must be a string, got {describe(value)}")
    # Ids become file names in the output folder: nothing that could name a path or a hidden file.
    elif not _ID_RE.fullmatch(value) or value.startswith(".") or ".." in value:
        rule = "use 1-128 characters from A-Z a-z 0-9 . _ -, not starting with '.' and without '..'"
        out.add("id", f"{_show(value)} is not a safe file name: {rule}")
    elif value.lower().split(".")[0] in RESERVED_IDS:  # summary.json, summary.shard0of4.json
        out.add("id", f"{value!r} is reserved: its {value}.json sidecar would overwrite the job's summary")
    else:
        return value
    return None


def _check_text(out: LineErrors, key: str, value: Any) -> str | None:
    if not isinstance(value, str):
        out.add(key, f"must be a string, got {describe(value)}")
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a lone "\ud800" escape decodes, then breaks the tokenizer and sidecar
        out.add(key, "contains an unpaired surrogate escape (e.g. \\ud800) and is not valid Unicode text")
        return None
    return value


def check_prompts(out: LineErrors, obj: JsonObject) -> dict[str, str | None]:
    prompt = _get(obj, "prompt")
    if prompt is _ABSENT:
        out.add("prompt", "missing: every request needs a non-empty prompt")
    elif (prompt := _check_text(out, "prompt", prompt)) is not None and not prompt.strip():
        out.add("prompt", "must not be empty or whitespace only")
    negative = _get(obj, "negative_prompt")
    negative = None if negative is _ABSENT else _check_text(out, "negative_prompt", negative)
    return {"prompt": prompt, "negative_prompt": negative}


def check_frames(out: LineErrors, obj: JsonObject, limits: ModelLimits) -> int | None:
    value = _get(obj, "num_frames")
    default = value is _ABSENT  # the default is checked too, in case a model's limits cannot represent it
    frames = limits.defaults.video_frames if default else _number(out, "num_frames", value, integer=True)
    if frames is None:
        return None
    step = limits.temporal_factor
    if frames < 1:
        problem = f"num_frames must be >= 1, got {frames}"
    elif frames > limits.max_frames:
        problem = f"num_frames {frames} exceeds the maximum of {limits.max_frames}"
    elif frames > 1 and (frames - 1) % step:
        # The VAE compresses time by `step` after the first frame. 1 is not suggested: it would make an image.
        lower = (frames - 1) // step * step + 1
        choices = _nearest(lower, lower + step, step + 1, limits.max_frames)
        problem = (
            f"num_frames {frames} cannot be represented: use {choices} (video frame counts are {step}k+1)"
        )
    else:
        return frames
    out.add("num_frames", ("default " if default else "") + problem)
    return None


def check_size(
    out: LineErrors, obj: JsonObject, limits: ModelLimits, num_frames: int | None
) -> dict[str, int]:
    size, width, height = (_get(obj, key) for key in ("size", "width", "height"))
    if size is not _ABSENT:
        match = _SIZE_RE.fullmatch(size) if isinstance(size, str) else None
        if width is not _ABSENT or height is not _ABSENT:
            out.add("size", "give either size or width and height, not both")
        elif match is None:
            example = 'must be "WIDTHxHEIGHT" with a lowercase x, e.g. "832x480"'
            out.add("size", f"{example}, got {describe(size)}")
        else:
            return _check_sides(out, ("size", "size"), f"{size}: ", int(match[1]), int(match[2]), limits)
    elif width is _ABSENT and height is _ABSENT:
        w, h = limits.defaults.image_size if num_frames == 1 else limits.defaults.video_size
        return _check_sides(out, ("size", "size"), f"default size {w}x{h}: ", w, h, limits)
    elif width is _ABSENT or height is _ABSENT:
        given, missing = ("width", "height") if height is _ABSENT else ("height", "width")
        out.add(given, f'{given} needs {missing} too (or use size, e.g. "832x480")')
        _number(out, given, width if height is _ABSENT else height, integer=True)
    else:
        w, h = _number(out, "width", width, integer=True), _number(out, "height", height, integer=True)
        if w is not None and h is not None:
            return _check_sides(out, ("width", "height"), "", w, h, limits)
    return {}


def _check_sides(
    out: LineErrors, fields: tuple[str, str], prefix: str, width: int, height: int, limits: ModelLimits
) -> dict[str, int]:
    factor = limits.spatial_factor
    for field, name, value in ((fields[0], "width", width), (fields[1], "height", height)):
        if value < 1:
            out.add(field, f"{prefix}{name} must be positive, got {value}")
        elif value > limits.max_side:
            out.add(field, f"{prefix}{name} {value} exceeds the maximum of {limits.max_side}")
        elif value % factor:  # the VAE and the patch embedding need whole latent cells
            lower = value // factor * factor
            choices = _nearest(lower, lower + factor, factor, limits.max_side)
            out.add(field, f"{prefix}{name} {value} is not a multiple of {factor} (nearest valid: {choices})")
    return {"width": width, "height": height}


def _nearest(lower: int, upper: int, minimum: int, maximum: int) -> str:
    choices = [str(value) for value in (lower, upper) if minimum <= value <= maximum]
    return " or ".join(choices) if choices else "none within the limits"


def check_budget(
    out: LineErrors, limits: ModelLimits, width: int, height: int, num_frames: int, field: str | None = None
) -> None:
    """`field`: where to report (by default the frame count or size that made the request too big)."""
    latent_t = (num_frames - 1) // limits.temporal_factor + 1
    cells = -(-height // (limits.spatial_factor * 2)) * -(-width // (limits.spatial_factor * 2))
    tokens = latent_t * cells
    if tokens > limits.max_vision_tokens:
        out.add(
            field or ("num_frames" if num_frames > 1 else "size"),
            f"{width}x{height} x {num_frames} frames is {tokens:,} vision tokens, over the per-request "
            f"bound of {limits.max_vision_tokens:,} (raise it with --max-vision-tokens if the GPUs allow)",
        )


def check_numbers(
    out: LineErrors, obj: JsonObject, limits: ModelLimits, num_frames: int | None
) -> dict[str, Any]:
    """The scalar knobs, range-checked, with defaults filled in (None where the model decides)."""
    d = limits.defaults
    steps = d.image_steps if num_frames == 1 else d.video_steps
    # key -> (integer?, low, low allowed?, high, default)
    rules: dict[str, tuple[bool, float, bool, float, Any]] = {
        "fps": (False, 0, False, 240, d.fps),
        "num_inference_steps": (True, 1, True, limits.max_steps, steps),
        "guidance_scale": (False, 0, True, 100, d.guidance),
        "flow_shift": (False, 0, False, 100, d.flow_shift),
        "seed": (True, 0, True, MAX_SEED, None),
        "max_sequence_length": (True, 1, True, 1_000_000, None),
    }
    values: dict[str, Any] = {}
    for key, (integer, low, low_ok, high, default) in rules.items():
        raw = _get(obj, key)
        if raw is _ABSENT:
            values[key] = default
            continue
        value = values[key] = _number(out, key, raw, integer)
        if value is not None and not (low <= value <= high and (low_ok or value != low)):
            out.add(key, f"must be {'>=' if low_ok else '>'} {low} and <= {high}, got {describe(value)}")
    return values


def check_samples(out: LineErrors, obj: JsonObject) -> None:
    raw = _get(obj, "samples")
    if raw is _ABSENT:
        return
    value = _number(out, "samples", raw, integer=True)
    if value is not None and not 1 <= value <= MAX_SAMPLES:
        out.add("samples", f"must be >= 1 and <= {MAX_SAMPLES}, got {describe(value)}")


def _number(out: LineErrors, key: str, value: Any, integer: bool) -> Any:
    """The value as int (integer fields) or float, or None after reporting why it is not one."""
    # bool is an int subclass in Python, and 35.0 would be silently truncated somewhere: both are mistakes.
    if isinstance(value, bool) or not isinstance(value, int if integer else int | float):
        out.add(key, f"must be {'an integer' if integer else 'a number'}, got {describe(value)}")
    elif isinstance(value, float) and not math.isfinite(value):  # 1e999 parses to inf, not via NaN hook
        out.add(key, f"must be finite, got {value}")
    else:
        return value if integer else float(value)
    return None


def check_image(out: LineErrors, obj: JsonObject, base_dir: str | None, num_frames: int | None) -> str | None:
    value = _get(obj, "image")
    if value is _ABSENT or (value := _check_text(out, "image", value)) is None:
        return None
    if not value:
        out.add("image", "must be a path to an image file, got an empty string")
        return None
    if num_frames == 1:
        out.add("image", "image conditioning needs a video (num_frames > 1), but num_frames is 1")
    path = os.path.abspath(os.path.join(base_dir if base_dir is not None else os.getcwd(), value))
    if not os.path.isfile(path):
        out.add("image", f"image file not found: {path}")
        return None
    try:
        # A full decode: verify() reads only the headers, so a JPEG cut off in its scan data would pass
        # here and fail after the weights are loaded.
        with Image.open(path) as image:
            image.load()
    except Exception as exc:  # PIL reports bad files with many types (OSError, SyntaxError, struct.error...)
        out.add("image", f"{path} is not a readable image ({type(exc).__name__}: {_show(str(exc))})")
    return path


def check_extra_params(
    out: LineErrors, obj: JsonObject, transfer: bool = False, guardrails: bool = False
) -> dict[str, bool]:
    """`transfer`: the reference's Transfer text step takes prompts verbatim, so its templates are off.
    `guardrails`: whether the job runs them; a request's must agree (requests/guardrail_field.py)."""
    value = _get(obj, "extra_params")
    flags = {**EXTRA_PARAMS_DEFAULTS, "guardrails": guardrails}
    if transfer:
        flags.update(use_resolution_template=False, use_duration_template=False)
    if value is not _ABSENT and not isinstance(value, dict):
        out.add("extra_params", f"must be an object, got {describe(value)}")
    elif value is not _ABSENT:
        for key in getattr(value, "duplicates", ()):
            out.add(f"extra_params.{key}", "key appears more than once in this object")
        for key, flag in value.items():
            if key not in flags:
                out.add(f"extra_params.{key}", f"unknown key; allowed: {', '.join(EXTRA_PARAMS_DEFAULTS)}")
            elif not isinstance(flag, bool):
                out.add(f"extra_params.{key}", f"must be true or false, got {describe(flag)}")
            elif transfer and flag and key != "guardrails":
                out.add(f"extra_params.{key}", "Transfer takes its prompt verbatim (no templates)")
            else:
                flags[key] = flag
    if (why := guardrails_mismatch(flags.pop("guardrails"), guardrails)) is not None:
        out.add("extra_params.guardrails", why)
    return flags


def _show(text: str, limit: int = 60) -> str:
    """A user string for a message: quoted and escaped (no control characters reach a log), and short."""
    shown = repr(text)
    return shown if len(shown) <= limit else shown[: limit - 4] + "...'"


def describe(value: Any) -> str:
    """How a JSON value reads in 'must be X, got ...'."""
    if isinstance(value, bool):
        return f"a boolean ({'true' if value else 'false'})"
    if isinstance(value, NonFinite):
        return f"{value.name} (JSON numbers must be finite)"
    if isinstance(value, int | float):
        digits = str(value)
        return digits if len(digits) <= 40 else digits[:37] + "..."
    if isinstance(value, str):
        return f"a string ({_show(value)})"
    return {type(None): "null", list: "an array"}.get(type(value), "an object")
