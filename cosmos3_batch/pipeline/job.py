"""One `run`: validate everything, load the model, run the passes, write outputs, metrics and summary.

Order matters for users: every check that can fail on bad input (request file, token counts, --out,
checkpoint layout) runs before any weight is read, and raises `BadInput` (exit code 2).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

import cosmos3_batch
from cosmos3_batch.config import RunConfig
from cosmos3_batch.dist import pick_device
from cosmos3_batch.io import outputs
from cosmos3_batch.io.metrics import MetricsWriter, merge_metrics
from cosmos3_batch.model.loading import Checkpoint, CheckpointError
from cosmos3_batch.pipeline.context import build_helper, load_context, load_tokenizer
from cosmos3_batch.pipeline.denoise import RequestJob, Result
from cosmos3_batch.pipeline.runner import PassRunner, ResidentWeights
from cosmos3_batch.requests import ModelLimits, Request, RequestError, RequestFileError, load_requests

log = logging.getLogger("cosmos3_batch")


class BadInput(ValueError):
    """Bad requests, flags or checkpoint, found before any weight was loaded (exit code 2)."""


@dataclass
class Plan:
    model_dir: Path
    requests: list[Request]  # to generate now
    invalid: list[RequestError]  # skipped with --skip-invalid
    complete: list[Request]  # already done by an earlier run (resume)
    tokenizer: object = None


def limits_for(checkpoint: Checkpoint) -> ModelLimits:
    vae = checkpoint.config("vae")
    return ModelLimits(
        spatial_factor=int(vae.get("scale_factor_spatial", 16)),
        temporal_factor=int(vae.get("scale_factor_temporal", 4)),
    )


def token_errors(requests: list[Request], helper, model_limit: int) -> list[RequestError]:
    """Prompts are tokenized with their templates exactly as generation will; over-long ones are rejected."""
    errors = []
    for r in requests:
        cond, uncond = helper.tokenize_prompt(
            r.prompt,
            r.negative_prompt,
            num_frames=r.num_frames,
            height=r.height,
            width=r.width,
            fps=r.fps,
            add_resolution_template=r.use_resolution_template,
            add_duration_template=r.use_duration_template,
        )
        limit = min(model_limit, r.max_sequence_length or model_limit)
        for name, ids in (("prompt", cond), ("negative_prompt", uncond)):
            if len(ids) > limit:
                errors.append(
                    RequestError(
                        r.line,
                        name,
                        f"{len(ids)} tokens after templating exceed the limit of {limit} "
                        f"({'max_sequence_length' if r.max_sequence_length else 'the model'})",
                    )
                )
    return errors


def plan_run(cfg: RunConfig) -> Plan:
    from cosmos3_batch.model.tiny import ensure_default_tiny

    model_dir = cfg.model if cfg.model is not None else ensure_default_tiny()
    try:
        checkpoint = Checkpoint.open(model_dir)
        requests, invalid = load_requests(str(cfg.prompts), limits_for(checkpoint), cfg.skip_invalid)
    except (CheckpointError, RequestFileError) as exc:
        raise BadInput(str(exc)) from exc
    outputs.check_writable(cfg.out)
    tokenizer = load_tokenizer(checkpoint)
    helper = build_helper(checkpoint, tokenizer)  # on meta modules: no weights are read
    errors = token_errors(requests, helper, int(getattr(tokenizer, "model_max_length", 1 << 30)))
    if errors and not cfg.skip_invalid:
        raise BadInput(str(RequestFileError(str(cfg.prompts), errors)))
    bad_lines = {e.line for e in errors}
    invalid = sorted(invalid + errors, key=lambda e: e.line)
    requests = [r for r in requests if r.line not in bad_lines]
    todo, complete = [], []
    for r in requests:
        done, why = outputs.is_complete(outputs.paths_for(cfg.out, r.id, r.num_frames), r.content_hash())
        if done and not cfg.overwrite:
            complete.append(r)
            continue
        if why == "request changed since it was generated":
            log.warning("%s: %s; generating it again", r.id, why)
        todo.append(r)
    return Plan(Path(model_dir), todo, invalid, complete, tokenizer)


def versions() -> dict[str, str]:
    import diffusers
    import transformers

    return {
        "cosmos3_batch": cosmos3_batch.__version__,
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
    }


@dataclass
class ResultWriter:
    """Writes each finished request's files (sidecar last) and its metrics row."""

    cfg: RunConfig
    model_dir: Path
    metrics: MetricsWriter
    rank: int = 0
    progress: tqdm | None = None
    ok: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)

    def __call__(self, job: RequestJob, result: Result | None, error: str | None) -> None:
        r = job.request
        write_s, output = 0.0, ""
        if result is not None:
            start = time.perf_counter()
            try:
                output = self._write(job, result)
            except Exception as exc:  # disk full, encoder error: this request fails, the job goes on
                error = f"{type(exc).__name__}: {exc}"
            write_s = time.perf_counter() - start
        if error is None:
            self.ok.append(r.id)
        else:
            self.failed[r.id] = error
            log.warning("request %s failed: %s", r.id, error)
        self.metrics.row(
            id=r.id,
            status="ok" if error is None else "failed",
            kind=r.kind,
            width=r.width,
            height=r.height,
            num_frames=r.num_frames,
            steps=r.num_inference_steps,
            guidance=r.guidance_scale,
            seed=r.seed,
            tokens=job.tokens,
            write_s=write_s,
            rank=self.rank,
            finished_at=time.time(),
            output=output,
            error=error,
            **{k: job.timings.get(k) for k in ("latency_s", "prepare_s", "denoise_s", "decode_s")},
        )
        if self.progress is not None:
            self.progress.update(1)

    def _write(self, job: RequestJob, result: Result) -> str:
        r = job.request
        paths = outputs.paths_for(self.cfg.out, r.id, r.num_frames)
        frames = outputs.to_uint8(result.frames)
        if r.num_frames == 1:
            size = outputs.write_png(paths.media, frames[0])
        else:
            size = outputs.write_mp4(paths.media, frames, r.fps)
        files = {"media": {"name": paths.media.name, "bytes": size}}
        if self.cfg.save_latents:
            size = outputs.write_latents(paths.latents, result.latents)
            files["latents"] = {"name": paths.latents.name, "bytes": size}
        sidecar = {
            "id": r.id,
            "status": "complete",
            "kind": r.kind,
            "request": r.resolved(),
            "request_hash": r.content_hash(),
            "seed": r.seed,
            "tokens": job.tokens,
            "files": files,
            "timings": {k: round(v, 6) for k, v in job.timings.items()},
            "model": str(self.model_dir),
            "versions": versions(),
        }
        outputs.write_json(paths.sidecar, sidecar)
        return paths.media.name


def run_job(cfg: RunConfig) -> int:
    """Returns the exit code: 0 all requests ok, 1 some failed. Raises BadInput for exit code 2."""
    started = time.time()
    plan = plan_run(cfg)
    log.info(
        "%d requests to generate, %d already complete, %d invalid",
        len(plan.requests),
        len(plan.complete),
        len(plan.invalid),
    )
    device = pick_device(cfg.device)
    ctx = load_context(plan.model_dir, device, vae_tiling=cfg.vae_tiling, tokenizer=plan.tokenizer)
    metrics = MetricsWriter(cfg.out, rank=0)
    bar = tqdm(total=len(plan.requests), unit="req", disable=not cfg.progress, dynamic_ncols=True)
    writer = ResultWriter(cfg, plan.model_dir, metrics, progress=bar)
    try:
        runner = PassRunner(ctx, ResidentWeights(ctx.layers), cfg.max_active, writer)
        runner.run(plan.requests)
    finally:
        bar.close()
        metrics.close()
        merge_metrics(cfg.out)
    wall = time.time() - started
    summary = {
        "requests_in_file": len(plan.requests) + len(plan.complete) + len(plan.invalid),
        "generated_ok": len(writer.ok),
        "failed": [{"id": k, "error": v} for k, v in sorted(writer.failed.items())],
        "skipped_complete": len(plan.complete),
        "invalid": [{"line": e.line, "field": e.field, "error": e.message} for e in plan.invalid],
        "wall_s": round(wall, 3),
        "outputs_per_minute": round(60 * len(writer.ok) / wall, 3) if wall > 0 else None,
        "passes": runner.passes,
        "config": {"model": str(plan.model_dir), "max_active": cfg.max_active, "device": str(device)},
        "versions": versions(),
    }
    outputs.write_json(cfg.out / "summary.json", summary)
    if writer.failed:
        log.error("%d request(s) failed: %s", len(writer.failed), ", ".join(sorted(writer.failed)))
    return 1 if writer.failed else 0


def describe_summary(out: Path) -> str:
    summary = json.loads((out / "summary.json").read_text())
    return (
        f"{summary['generated_ok']} generated, {len(summary['failed'])} failed, "
        f"{summary['skipped_complete']} already complete, {len(summary['invalid'])} invalid -> {out}"
    )
