"""What a request the guardrails blocked leaves (docs/guardrails.md): its sidecar `<id>.json` with status
`blocked`, the check that blocked it and the guardrail's reason, and a metrics row (status `blocked`, the
reason in `error`); no media under its name. A blocked request is an outcome, not a failure: it is done for
resume (`is_blocked`) and does not make the job exit 1."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

from cosmos3_batch.io import outputs
from cosmos3_batch.io.metrics import iso_time
from cosmos3_batch.requests.parse import Request

log = logging.getLogger("cosmos3_batch")
NOT_COMPLETE = "sidecar not complete"


@dataclass(frozen=True)
class Blocked:
    """A job's outcome that the loop found blocked (an upsampled prompt: passes/chains.py), handed to the
    finisher in place of a result so its record is written in order with the other reports."""

    reason: str
    stage: str  # what io/outputs.is_complete says of a sidecar like a blocked one's


def record_blocked(writer, r: Request, reason: str, stage: str, key: str, versions: dict, job=None) -> None:
    """`writer`: the rank's ResultWriter (results.py: `block`); `stage`: "prompt" (before admission),
    "upsampled prompt" (the reasoner's rewrite, before generation), "video" (the decoded frames) or "reply"
    (a reasoner request's generated text); from the second on, `job` says what the request cost; `key`: its
    output_key."""
    writer.blocked[r.id] = reason
    log.warning("request %s blocked by the %s guardrail: %s", r.id, stage, reason)
    paths = outputs.paths_for(writer.cfg.out, r.id, r.num_frames, writer.layout)
    paths.sidecar.parent.mkdir(exist_ok=True)  # --layout nested: its folder, made on first use
    source = writer.cfg.model_source
    sidecar = {
        "id": r.id,
        "status": "blocked",
        "blocked": {"stage": stage, "reason": reason},
        "kind": r.kind,
        "request": r.resolved(),
        "request_hash": r.content_hash(),
        "output_key": key,
        "seed": r.seed,
        **(source.record() if source else {"model": str(writer.model_dir)}),
        "model_digest": writer.model_identity,
        "rank": writer.rank,
        "guardrails": writer.guardrails,
        "versions": versions,
        **({} if job is None else {"timings": {k: round(v, 6) for k, v in job.timings.items()}}),
    }
    outputs.write_json(paths.sidecar, sidecar)
    row = dict(id=r.id, status="blocked", kind=r.kind, width=r.width, height=r.height, seed=r.seed)
    row.update(num_frames=r.num_frames, steps=r.num_inference_steps, guidance=r.guidance_scale)
    row.update(rank=writer.rank, finished_at=iso_time(time.time()), error=reason)
    if job is not None:
        row.update({k: job.timings.get(k) for k in ("prepare_s", "denoise_s", "decode_s")}, tokens=job.tokens)
    writer._append_row(row)


def is_blocked(sidecar_path, content_hash: str, key: str) -> bool:
    """Resume: this request, with this model and these settings, was blocked by an earlier run."""
    try:
        sidecar = json.loads(sidecar_path.read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(sidecar, dict)
        and sidecar.get("status") == "blocked"
        and sidecar.get("request_hash") == content_hash
        and sidecar.get("output_key") == key
    )
