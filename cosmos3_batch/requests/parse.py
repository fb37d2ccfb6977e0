"""JSONL request file -> validated `Request` objects (DESIGN.md §6).

Everything a user can get wrong in a request file is found here (field rules in requests/fields.py),
before any weight is loaded, and reported all at once with line and field, so one edit fixes the
whole file. The module imports no torch/diffusers: the CLI can check a file in milliseconds.
"""

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from cosmos3_batch.requests.actions import ActionSpec, check_action_request, has_action
from cosmos3_batch.requests.fields import (
    DEFAULT_FPS,
    DEFAULT_GUIDANCE,
    DEFAULT_LIMITS,
    MAX_SEED,
    JsonObject,
    LineErrors,
    ModelLimits,
    NonFinite,
    RequestError,
    check_budget,
    check_extra_params,
    check_frames,
    check_id,
    check_image,
    check_keys,
    check_numbers,
    check_prompts,
    check_size,
    describe,
)
from cosmos3_batch.requests.modes import check_sound, check_system_prompt, check_video

__all__ = ["DEFAULT_FPS", "DEFAULT_GUIDANCE", "ModelLimits", "Request", "RequestError", "RequestFileError"]


@dataclass(frozen=True)
class Request:
    """One validated request with every default filled in: what runs is exactly what is recorded."""

    id: str
    line: int  # 1-based line number in the JSONL file
    prompt: str
    negative_prompt: str | None
    width: int
    height: int
    num_frames: int
    fps: float
    num_inference_steps: int
    guidance_scale: float
    seed: int  # from the JSONL, else derived from the id (never from line order or rank)
    max_sequence_length: int | None
    flow_shift: float | None  # None = use the checkpoint scheduler's flow_shift
    image: str | None  # absolute path
    use_resolution_template: bool = True
    use_duration_template: bool = True
    video: str | None = None  # absolute path: video-to-video
    condition_frames: tuple[int, ...] | None = None  # latent frames kept clean (V2V only)
    condition_video_keep: str | None = None  # "first" | "last" (V2V only)
    system_prompt: bool | None = None  # None = the checkpoint's default_use_system_prompt
    sound: bool = False  # joint audio: <id>.wav and an AAC track in <id>.mp4
    action: ActionSpec | None = None  # forward/inverse dynamics, policy (conditioned on image or video)

    @property
    def kind(self) -> str:
        if self.action is not None:
            return f"{self.action.mode}+sound" if self.sound else self.action.mode
        if self.num_frames == 1:
            return "t2i"
        base = "v2v" if self.video is not None else "i2v" if self.image is not None else "t2v"
        return f"{base}+sound" if self.sound else base

    def resolved(self) -> dict[str, Any]:
        """Every field but `line`: moving a request within its file must not change its record or hash.

        Mode fields left at their "not used" value are omitted, so a request that uses none of them records
        and hashes exactly as before they existed (outputs of earlier runs stay complete on resume)."""
        fields = dataclasses.asdict(self)
        del fields["line"]
        for key, unused in _MODE_FIELDS.items():
            if fields[key] is unused:
                del fields[key]
        return fields

    def content_hash(self) -> str:
        canonical = json.dumps(self.resolved(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


# Mode fields and the value that means "not used": such fields are left out of the resolved record.
_MODE_FIELDS = {
    "video": None,
    "condition_frames": None,
    "condition_video_keep": None,
    "system_prompt": None,
    "sound": False,
    "action": None,
}


class RequestFileError(ValueError):
    """Raised with every problem of the file at once."""

    def __init__(self, source: str, errors: list[RequestError]):
        self.source = source
        self.errors = list(errors)
        super().__init__("\n".join(f"{source}: {error}" for error in self.errors))

    def __reduce__(self) -> tuple[type, tuple[str, list[RequestError]]]:
        # ValueError pickles as cls(*args), which does not fit this __init__; errors may cross processes.
        return (type(self), (self.source, self.errors))


def derive_seed(request_id: str) -> int:
    """A seed that depends on the id alone, so a request draws the same noise however the job is split."""
    digest = hashlib.sha256(request_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") & MAX_SEED


def parse_lines(
    lines: Iterable[bytes],
    source: str = "<input>",
    base_dir: str | None = None,
    limits: ModelLimits = DEFAULT_LIMITS,
) -> tuple[list[Request], list[RequestError]]:
    """Validate every line; return the good requests and all errors (never raises for user errors).

    `source` names the input for callers that build a RequestFileError from the result; relative
    `image` paths resolve against `base_dir` (the current directory when None).
    """
    requests: list[Request] = []
    errors: list[RequestError] = []
    first_line_of: dict[str, int] = {}
    saw_request_line = False
    for line, raw in enumerate(lines, start=1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            saw_request_line = True
            bad = f"0x{raw[exc.start]:02x}"
            errors.append(RequestError(line, None, f"not valid UTF-8 (byte {bad} at offset {exc.start})"))
            continue
        if line == 1:
            text = text.removeprefix("\ufeff")  # Windows editors start files with a byte-order mark
        if not text.strip() or text.lstrip().startswith("#"):
            continue
        saw_request_line = True
        obj, problem = _parse_json(text)
        if problem is not None:
            errors.append(RequestError(line, None, problem))
            continue
        request, request_id, line_errors = _validate_object(obj, line, base_dir, limits)
        errors.extend(line_errors)
        if request_id is None:
            continue
        if request_id in first_line_of:
            how = " (derived from the line number)" if obj.get("id") is None else ""
            message = f"duplicate id {request_id!r}{how}: already used on line {first_line_of[request_id]}"
            errors.append(RequestError(line, "id", message))
            continue
        first_line_of[request_id] = line
        if request is not None:
            requests.append(request)
    if not saw_request_line:
        errors.append(RequestError(0, None, "no requests in file"))
    errors.sort(key=lambda error: error.line)  # stable: a line's errors keep their order
    return requests, errors


def load_requests(
    path: str, limits: ModelLimits = DEFAULT_LIMITS, skip_invalid: bool = False
) -> tuple[list[Request], list[RequestError]]:
    """Read and validate a JSONL file; raise RequestFileError with all problems unless skip_invalid.

    With skip_invalid the valid requests come back with the errors, for the caller to record.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise RequestFileError(path, [RequestError(0, None, f"cannot read request file: {reason}")]) from exc
    # Split on b"\n" only, so line numbers are the ones an editor and `wc -l` show; a "\r" left by
    # CRLF files is whitespace to the JSON parser.
    base_dir = os.path.dirname(os.path.abspath(path))
    requests, errors = parse_lines(data.split(b"\n"), source=path, base_dir=base_dir, limits=limits)
    if errors and not skip_invalid:
        raise RequestFileError(path, errors)
    return requests, errors


def _object_from_pairs(pairs: list[tuple[str, Any]]) -> JsonObject:
    obj = JsonObject(pairs)
    if len(obj) < len(pairs):
        keys = [key for key, _ in pairs]
        obj.duplicates = tuple(sorted({key for key in keys if keys.count(key) > 1}))
    return obj


def _parse_json(text: str) -> tuple[JsonObject, None] | tuple[None, str]:
    try:
        obj = json.loads(text, parse_constant=NonFinite, object_pairs_hook=_object_from_pairs)
    except json.JSONDecodeError as exc:
        return None, f"not valid JSON: {exc.msg} (column {exc.colno})"
    except ValueError:  # an integer literal past Python's int conversion limit (4300 digits)
        return None, "not valid JSON: a number has too many digits"
    except RecursionError:
        return None, "not valid JSON: nested too deeply"
    if not isinstance(obj, dict):
        return None, f"each line must be a JSON object, got {describe(obj)}"
    return obj, None


def _validate_object(
    obj: JsonObject, line: int, base_dir: str | None, limits: ModelLimits
) -> tuple[Request | None, str | None, list[RequestError]]:
    """Check one decoded line. Returns (request or None, its id if the id is valid, errors)."""
    out = LineErrors(line)
    check_keys(out, obj)
    request_id = check_id(out, obj, line)
    prompts = check_prompts(out, obj)
    if has_action(obj):  # size and frame count come from the action's tier and chunk size
        media, num_frames = check_action_request(out, obj, base_dir, limits)
    else:
        num_frames = check_frames(out, obj, limits)
        media = {
            **check_size(out, obj, limits, num_frames),
            "image": check_image(out, obj, base_dir, num_frames),
            **check_video(out, obj, base_dir, num_frames, limits.temporal_factor),
            "sound": check_sound(out, obj, limits, num_frames),
        }
    values = {
        **prompts,
        **media,
        **check_numbers(out, obj, limits, num_frames),
        "system_prompt": check_system_prompt(out, obj),
        **check_extra_params(out, obj),
    }
    if not out.errors and num_frames is not None:
        # An action request's size comes from its tier and chunk size: the budget names the action.
        where = "action" if values.get("action") is not None else None
        check_budget(out, limits, values["width"], values["height"], num_frames, where)
    if out.errors:
        return None, request_id, out.errors
    assert request_id is not None and num_frames is not None
    if values["seed"] is None:
        values["seed"] = derive_seed(request_id)
    return Request(id=request_id, line=line, num_frames=num_frames, **values), request_id, []
