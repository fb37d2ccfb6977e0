"""The request checks that need the checkpoint's tokenizer: `run` and `plan --model` both call them, so plan
rejects what run rejects, with the same message and line (issue 49: plan used to pass a prompt that run then
refused as too long).

Prompts are tokenized with their templates exactly as generation will tokenize them; only the tokenizer and
meta-device modules are built, no weight is read.
"""

from __future__ import annotations

from collections.abc import Sequence

from cosmos3_batch.checkpoint.folder import Checkpoint
from cosmos3_batch.model.prompts import build_helper, load_tokenizer, tokenize
from cosmos3_batch.requests.parse import ModelLimits, Request, RequestError, RequestFileError, load_requests
from cosmos3_batch.requests.sources import ALL_NAMED, Columns


def token_errors(requests: list[Request], helper, model_limit: int) -> list[RequestError]:
    """Prompts are tokenized with their templates exactly as generation will; over-long ones are rejected."""
    errors: list[RequestError] = []
    seen: set[tuple[str, int]] = set()
    lengths: dict[tuple, tuple[int, int]] = {}  # each distinct templating tokenized once (plan: a million)
    for r in requests:
        if (r.source, r.line) in seen:  # the other samples of a line: the same prompts
            continue
        seen.add((r.source, r.line))
        key = (r.prompt, r.negative_prompt, r.action, r.num_frames, r.height, r.width, r.fps, r.system_prompt,
               r.use_resolution_template, r.use_duration_template)  # fmt: skip
        if key not in lengths:
            cond, uncond = tokenize(helper, r)
            lengths[key] = (len(cond), len(uncond))
        limit = min(model_limit, r.max_sequence_length or model_limit)
        for name, count in zip(("prompt", "negative_prompt"), lengths[key], strict=True):
            if count > limit:
                why = "max_sequence_length" if r.max_sequence_length else "the model"
                message = f"{count} tokens after templating exceed the limit of {limit} ({why})"
                errors.append(RequestError(r.line, name, message, source=r.source, unit=r.unit))
    return errors


def model_limit(tokenizer) -> int:
    """The tokenizer's own limit on a prompt's tokens (none: no limit but the request's)."""
    return int(getattr(tokenizer, "model_max_length", 1 << 30))


def checkpoint_token_errors(checkpoint: Checkpoint, requests: list[Request]) -> list[RequestError]:
    """`token_errors` with the checkpoint's tokenizer and templates (what `plan --model` checks)."""
    tokenizer = load_tokenizer(checkpoint)
    return token_errors(requests, build_helper(checkpoint, tokenizer), model_limit(tokenizer))


def checked_requests(
    prompts: str | Sequence[str],
    checkpoint: Checkpoint | None,
    limits: ModelLimits,
    *,
    samples: int = 1,
    columns: Columns = ALL_NAMED,
    stdin: bytes | None = None,
    input_format: str = "auto",
) -> list[Request]:
    """The valid requests of PROMPTS as `run` takes them, for `plan`: RequestFileError naming every problem
    `run` would name before loading (with a checkpoint, the token counts too), in its order and words."""
    requests, invalid = load_requests(
        prompts,
        limits,
        skip_invalid=True,
        samples=samples,
        columns=columns,
        stdin=stdin,
        input_format=input_format,
    )
    if checkpoint is not None:
        invalid += checkpoint_token_errors(checkpoint, requests)
    if invalid:
        inputs = [prompts] if isinstance(prompts, str) else list(prompts)
        raise RequestFileError(", ".join(map(str, inputs)), invalid)
    return requests
