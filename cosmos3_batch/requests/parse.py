"""Request files -> validated `Request` objects (DESIGN.md §6, §13).

Everything a user can get wrong in a request file is found here (field rules in requests/fields.py; the
formats in requests/sources.py), before any weight is loaded, and reported all at once with file, line
(or row) and field, so one edit fixes the whole input. `"samples": N` becomes N ordinary requests here.
The module imports no torch/diffusers: the CLI can check a file in milliseconds.
"""

import contextlib
import dataclasses
import gc
import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from cosmos3_batch.requests.actions import ActionSpec, check_action_request, has_action
from cosmos3_batch.requests.chain import CaptionSpec, ChainDefaults, UpsampleSpec, check_chain
from cosmos3_batch.requests.cosmos_load import is_theirs, read_samples, settle
from cosmos3_batch.requests.fields import (
    DEFAULT_FPS,
    DEFAULT_GUIDANCE,
    DEFAULT_LIMITS,
    MAX_SAMPLES,
    MAX_SEED,
    JsonObject,
    LineErrors,
    ModelLimits,
    RequestError,
    check_budget,
    check_extra_params,
    check_frames,
    check_id,
    check_image,
    check_keys,
    check_numbers,
    check_prompts,
    check_samples,
    check_size,
)
from cosmos3_batch.requests.modes import check_distilled, check_sound, check_system_prompt, check_video
from cosmos3_batch.requests.reason import ReasonSpec, check_reason_request, has_reason
from cosmos3_batch.requests.sources import ALL_NAMED, Columns, Source, expand, jsonl_items, read_source
from cosmos3_batch.requests.transfer import TransferSpec, check_transfer_request, has_transfer, stray_fields

__all__ = ["DEFAULT_FPS", "DEFAULT_GUIDANCE", "ModelLimits", "Request", "RequestError", "RequestFileError"]


@dataclass(frozen=True, slots=True)  # slots: a million of them fit a laptop's `plan` (docs/scale.md)
class Request:
    """One validated request with every default filled in: what runs is exactly what is recorded."""

    id: str
    line: int  # 1-based place in its file: the line (JSONL, CSV), the item (JSON array) or the row (Parquet)
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
    transfer: TransferSpec | None = None  # control-conditioned generation (requests/transfer.py)
    reason: ReasonSpec | None = None  # the reasoner: text out (requests/reason.py); generation fields unused
    upsample: UpsampleSpec | None = None  # its prompt rewritten by the reasoner first (requests/chain.py)
    captions: CaptionSpec | None = None  # its output captioned / scored by the reasoner after decode
    # Set on the request that generates from an upsampled prompt (`prompt` is then the upsampled text): the
    # file's prompt, which its record and hash keep, and what the upsampling did (kinds/chained.py).
    prompt_original: str | None = None
    upsampled: dict | None = None
    source: str = ""  # the file it came from ("<stdin>" for standard input); not part of its record
    unit: str = "line"  # what `line` counts there: line, item (JSON array) or row (Parquet)
    sample: str | None = None  # an NVIDIA sample's `name` (requests/cosmos_load.py); not part of its record

    @property
    def kind(self) -> str:
        if self.reason is not None:
            return "reason"
        if self.transfer is not None:
            return "transfer"
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
        # A shallow copy (the fields are immutable), the action spec as a dict: what dataclasses.asdict gives,
        # at a tenth of its cost (a rerun hashes every request of the file).
        fields = {name: getattr(self, name) for name in _RECORDED}
        if self.action is not None:
            fields["action"] = dataclasses.asdict(self.action)
        if self.transfer is not None:
            fields["transfer"] = dataclasses.asdict(self.transfer)
        if self.reason is not None:
            fields["reason"] = dataclasses.asdict(self.reason)
        if self.upsample is not None:
            fields["upsample"] = self.upsample.record()
        if self.captions is not None:
            fields["captions"] = dataclasses.asdict(self.captions)
        if self.prompt_original is not None:  # generated from its upsampled prompt: the same request
            fields["prompt"] = self.prompt_original
        for key, unused in _MODE_FIELDS.items():
            if fields[key] is unused:
                del fields[key]
        return fields

    def content_hash(self) -> str:
        canonical = json.dumps(self.resolved(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


_RECORDED = tuple(
    f.name
    for f in dataclasses.fields(Request)
    if f.name not in ("line", "source", "unit", "sample", "prompt_original", "upsampled")
)
# Mode fields and the value that means "not used": such fields are left out of the resolved record.
_MODE_FIELDS = {
    "video": None,
    "condition_frames": None,
    "condition_video_keep": None,
    "system_prompt": None,
    "sound": False,
    "action": None,
    "transfer": None,
    "reason": None,
    "upsample": None,
    "captions": None,
}


class RequestFileError(ValueError):
    """Raised with every problem of the file at once."""

    def __init__(self, source: str, errors: list[RequestError]):
        self.source = source
        self.errors = list(errors)
        super().__init__("\n".join(_collapsed(self.errors, source)))

    def __reduce__(self) -> tuple[type, tuple[str, list[RequestError]]]:
        # ValueError pickles as cls(*args), which does not fit this __init__; errors may cross processes.
        return (type(self), (self.source, self.errors))


SAME_SHOWN = 3  # identical errors on more lines than this are said once, with the lines they are on


def _collapsed(errors: list[RequestError], source: str) -> list[str]:
    """One line per error, except a run of the same error (the same field and message: a checkpoint that
    lacks what every line asks, a flag's limit) on consecutive lines, which is said once with its lines:
    512 identical lines hide the one that differs."""
    said: list[str] = []
    run: list[RequestError] = []

    def flush() -> None:
        if len(run) > SAME_SHOWN:
            first, lines = run[0], [str(e.line) for e in run]
            shown = ", ".join(lines[:8]) + (", ..." if len(lines) > 8 else "")
            said.append(f"{first.source or source}: {first} (the same on {len(run)} {first.unit}s: {shown})")
        else:
            said.extend(f"{error.source or source}: {error}" for error in run)
        run.clear()

    for error in errors:
        if run and (error.source, error.unit, error.field, error.message) != (
            run[0].source, run[0].unit, run[0].field, run[0].message
        ):  # fmt: skip
            flush()
        run.append(error)
    flush()
    return said


def derive_seed(request_id: str) -> int:
    """A seed that depends on the id alone, so a request draws the same noise however the job is split."""
    digest = hashlib.sha256(request_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") & MAX_SEED


def shard_index(request_id: str, count: int) -> int:
    """The --shard INDEX/COUNT slice a request belongs to (by a hash of its id: the slice holds when other
    lines change). Here, below plan/ and io/, because both the schedule and `status` ask it."""
    digest = hashlib.sha256(request_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % count


def parse_lines(
    lines: Iterable[bytes],
    source: str = "<input>",
    base_dir: str | None = None,
    limits: ModelLimits = DEFAULT_LIMITS,
) -> tuple[list[Request], list[RequestError]]:
    """Validate JSONL lines; return the good requests and all errors (never raises for user errors).

    `source` names the input in errors; relative `image` paths resolve against `base_dir` (the current
    directory when None)."""
    items = list(jsonl_items(b"\n".join(lines)))
    parsed = Source(source, base_dir or os.getcwd(), items=items)
    parsed.problem = None if items else "no requests in file"
    return parse_sources([parsed], limits)


def parse_sources(
    sources: Sequence[Source], limits: ModelLimits = DEFAULT_LIMITS, samples: int = 1
) -> tuple[list[Request], list[RequestError]]:
    """Validate every item of every source; the good requests (samples expanded) and all errors, in file
    order. Ids are unique across all sources. `samples` is --samples-per-prompt (the field wins)."""
    requests: list[Request] = []
    errors: list[RequestError] = []
    first_place: dict[str, str] = {}  # id -> where it was first seen
    for source in sources:
        found: list[RequestError] = []
        if source.problem is not None:
            found.append(RequestError(0, None, source.problem))
        items, source.items = source.items, []  # consumed: each decoded object is let go once checked
        for index in range(len(items)):
            item, items[index] = items[index], None
            if item.obj is None:
                found.append(RequestError(item.number, None, item.problem or "not a request"))
                continue
            checked = _validate_object(item.obj, item.number, source, limits)
            request, request_id, item_errors = checked
            found += item_errors
            if request_id is None:
                continue
            for rid, sample in _samples(request_id, item.obj, request, samples, found, item.number):
                if rid in first_place:
                    how = " (derived from the line number)" if item.obj.get("id") is None else ""
                    message = f"duplicate id {rid!r}{how}: already used {first_place[rid]}"
                    found.append(RequestError(item.number, "id", message))
                    continue
                where = f" of {source.name}" if len(sources) > 1 else ""
                first_place[rid] = f"on {source.unit} {item.number}{where}"
                if sample is not None:
                    requests.append(sample)
        found.sort(key=lambda error: error.line)  # stable: a line's errors keep their order
        errors += [dataclasses.replace(e, source=source.name, unit=source.unit) for e in found]
    return requests, errors


def _samples(
    request_id: str, obj: JsonObject, request: Request | None, default: int, found: list, line: int
) -> list[tuple[str, Request | None]]:
    """(id, request or None if invalid) of each sample of one item: itself when it names no `samples` and
    --samples-per-prompt is 1, else `<id>-<k>` with seed + k, k zero-padded to the width of N."""
    count = obj.get("samples", default)
    if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= MAX_SAMPLES:
        return [(request_id, None)]  # check_samples named the field (and no huge id list is built)
    if "samples" not in obj and count == 1:
        return [(request_id, request)]
    width = len(str(count))
    ids = [f"{request_id}-{k:0{width}d}" for k in range(count)]
    if len(ids[-1]) > 128:
        found.append(RequestError(line, "samples", f"ids such as {ids[-1]!r} pass 128 characters"))
        return []
    if request is not None and request.seed + count - 1 > MAX_SEED:
        message = f"seeds {request.seed} + 0..{count - 1} pass the largest seed {MAX_SEED}"
        found.append(RequestError(line, "samples", message))
        return []
    if request is None:
        return [(rid, None) for rid in ids]
    return [(rid, dataclasses.replace(request, id=rid, seed=request.seed + k)) for k, rid in enumerate(ids)]


def load_requests(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    limits: ModelLimits = DEFAULT_LIMITS,
    skip_invalid: bool = False,
    *,
    samples: int = 1,
    columns: Columns = ALL_NAMED,
    stdin: bytes | None = None,
    input_format: str = "auto",
) -> tuple[list[Request], list[RequestError]]:
    """Read and validate request files (paths, globs, "-" for the bytes of `stdin`); raise
    RequestFileError with all problems unless skip_invalid. `input_format`: --input-format (auto: NVIDIA
    cosmos-framework sample files are told apart by their keys, requests/cosmos_load.py).

    With skip_invalid the valid requests come back with the errors, for the caller to record. An input that
    is missing, unreadable, undecodable as a whole or holds no request (a glob matching nothing too) is a
    configuration error all the same: skip_invalid skips invalid requests, never missing inputs (a Slurm
    array task with a typo in its file name must not "succeed" having generated nothing).
    """
    arguments = [os.fspath(paths)] if isinstance(paths, str | os.PathLike) else [os.fspath(p) for p in paths]
    found, missing = expand(arguments)
    with no_cycle_collection():
        sources = [
            read_samples(path, limits) if is_theirs(path, input_format) else read_source(path, columns, stdin)
            for path in found
        ]
        requests, errors = settle(sources, *parse_sources(sources, limits, samples))
    errors = [RequestError(0, None, "no file matches this pattern", source=glob) for glob in missing] + errors
    inputs = [error for error in errors if error.line == 0]  # the whole input, not one of its requests
    if inputs or (errors and not skip_invalid):
        raise RequestFileError(", ".join(arguments), errors if not skip_invalid else inputs)
    return requests, errors


def by_request(errors: Iterable[RequestError]) -> list[list[RequestError]]:
    """The errors of each invalid request (its file and place), in the order first met: one list per
    request, so counts count requests, not errors."""
    groups: dict[tuple[str, int], list[RequestError]] = {}
    for error in errors:
        groups.setdefault((error.source, error.line), []).append(error)
    return list(groups.values())


@contextlib.contextmanager
def no_cycle_collection():
    """Python's cycle collector off while a million small objects are made, none of them in a cycle: it
    would walk them all again and again (16 of 41 s parsing a million requests). Restored after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _validate_object(
    obj: JsonObject, line: int, source: Source, limits: ModelLimits
) -> tuple[Request | None, str | None, list[RequestError]]:
    """Check one decoded line. Returns (request or None, its id if the id is valid, errors)."""
    base_dir = source.base_dir
    out = LineErrors(line)
    check_keys(out, obj)
    check_samples(out, obj)
    request_id = check_id(out, obj, line)
    prompts = check_prompts(out, obj)
    transfer = has_transfer(obj)
    reason = has_reason(obj)
    if reason:  # text out: the generation fields are refused, their defaults recorded unused
        media, num_frames = check_reason_request(out, obj, base_dir, limits)
    elif transfer:  # frame count from the controls; prompts verbatim, no templates (requests/transfer.py)
        media, num_frames = check_transfer_request(out, obj, base_dir, limits)
    elif has_action(obj):  # size and frame count come from the action's tier and chunk size
        media, num_frames = check_action_request(out, obj, base_dir, limits)
    else:
        stray_fields(out, obj)
        num_frames = check_frames(out, obj, limits)
        media = {
            **check_size(out, obj, limits, num_frames),
            "image": check_image(out, obj, base_dir, num_frames),
            **check_video(out, obj, base_dir, num_frames, limits.temporal_factor),
            "sound": check_sound(out, obj, limits, num_frames),
        }
    chain = ChainDefaults() if limits.chain is None else limits.chain
    if not reason:  # a reasoner line refuses these as generation fields (requests/reason.py)
        media.update(check_chain(out, obj, chain, limits.reasoner_missing))
    numbers = check_numbers(out, obj, limits, num_frames)
    check_distilled(out, obj, numbers, limits)
    values = {
        **prompts,
        **media,
        **numbers,
        "system_prompt": check_system_prompt(out, obj),
        **check_extra_params(out, obj, transfer, limits.guardrails),
    }
    if not out.errors and num_frames is not None and not transfer and not reason:  # Transfer counts per chunk
        # An action request's size comes from its tier and chunk size: the budget names the action.
        where = "action" if values.get("action") is not None else None
        check_budget(out, limits, values["width"], values["height"], num_frames, where)
    if out.errors:
        return None, request_id, out.errors
    assert request_id is not None and num_frames is not None
    if values["seed"] is None:
        values["seed"] = derive_seed(request_id)
    request = Request(
        id=request_id, line=line, num_frames=num_frames, source=source.name, unit=source.unit, **values
    )
    return request, request_id, []
