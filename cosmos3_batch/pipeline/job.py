"""One `run`: validate everything, load the model, run the passes, write outputs, metrics and summary.

Order matters for users: every check that can fail on bad input (request file, token counts, --out,
checkpoint layout) runs before any weight is read, and raises `BadInput` (exit code 2).
"""

from __future__ import annotations

import hashlib
import json
import logging
import signal as signal_module
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from tqdm import tqdm

import cosmos3_batch
from cosmos3_batch.config import RunConfig
from cosmos3_batch.dist import World, init_world, teardown
from cosmos3_batch.engine.transport import OffloadMode
from cosmos3_batch.io import outputs
from cosmos3_batch.io.metrics import MetricsWriter, iso_time, merge_metrics, write_passes
from cosmos3_batch.model.loading import Checkpoint, CheckpointError, validate_checkpoint
from cosmos3_batch.pipeline.context import build_helper, load_context, load_tokenizer
from cosmos3_batch.pipeline.denoise import RequestJob, Result, tokenize
from cosmos3_batch.pipeline.runner import PassRecord, PassRunner, PassSync
from cosmos3_batch.pipeline.stop import StopRequest
from cosmos3_batch.pipeline.weights import build_weights, weights_report
from cosmos3_batch.requests import ModelLimits, Request, RequestError, RequestFileError, load_requests
from cosmos3_batch.schedule import assign, in_shard

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
    model_identity: str = ""


def limits_for(checkpoint: Checkpoint, max_vision_tokens: int) -> ModelLimits:
    vae = checkpoint.config("vae")
    return ModelLimits(
        spatial_factor=int(vae.get("scale_factor_spatial", 16)),
        temporal_factor=int(vae.get("scale_factor_temporal", 4)),
        max_vision_tokens=max_vision_tokens,
    )


def token_errors(requests: list[Request], helper, model_limit: int) -> list[RequestError]:
    """Prompts are tokenized with their templates exactly as generation will; over-long ones are rejected."""
    errors = []
    for r in requests:
        cond, uncond = tokenize(helper, r)
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
        validate_checkpoint(checkpoint)
        # Collect the file's problems and the token-count problems, then report them all at once.
        requests, invalid = load_requests(
            str(cfg.prompts), limits_for(checkpoint, cfg.max_vision_tokens), skip_invalid=True
        )
    except (CheckpointError, RequestFileError) as exc:
        raise BadInput(str(exc)) from exc
    tokenizer = load_tokenizer(checkpoint)
    helper = build_helper(checkpoint, tokenizer)  # on meta modules: no weights are read
    errors = token_errors(requests, helper, int(getattr(tokenizer, "model_max_length", 1 << 30)))
    invalid = sorted(invalid + errors, key=lambda e: e.line)
    if invalid and not cfg.skip_invalid:
        raise BadInput(str(RequestFileError(str(cfg.prompts), invalid)))
    try:  # after the file checks: a bad file leaves no --out folder behind
        outputs.check_writable(cfg.out)
    except ValueError as exc:
        raise BadInput(str(exc)) from exc
    bad_lines = {e.line for e in errors}
    requests = [r for r in requests if r.line not in bad_lines]
    if cfg.shard is not None:
        requests = [r for r in requests if in_shard(r.id, *cfg.shard)]
    todo, complete = [], []
    identity = checkpoint.identity()
    if checkpoint.config("transformer").get("quantization_config"):
        # FP8: the compute policy decides the bytes too (W8A8 steps on GPUs), so it is part of the model.
        identity = f"{identity}+fp8-{cfg.fp8_compute}"
    for r in requests:
        paths = outputs.paths_for(cfg.out, r.id, r.num_frames)
        key = output_key(r, identity, cfg.vae_tiling)
        done, why = outputs.is_complete(paths, r.content_hash(), key, cfg.save_latents)
        if done and not cfg.overwrite:
            complete.append(r)
            continue
        if paths.sidecar.exists() and not cfg.overwrite:
            log.warning("%s: %s; generating it again", r.id, why)
        todo.append(r)
    return Plan(Path(model_dir), todo, invalid, complete, tokenizer, identity)


def output_key(r: Request, model_identity: str, vae_tiling: bool) -> str:
    """What besides the request decides the output bytes: the model and how we decode."""
    text = json.dumps([r.content_hash(), model_identity, vae_tiling])
    return hashlib.sha256(text.encode()).hexdigest()


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
    """Writes each finished request's files (sidecar last) and its metrics row (columns: README, Outputs)."""

    cfg: RunConfig
    model_dir: Path
    metrics: MetricsWriter
    model_identity: str
    rank: int = 0
    weights: dict | None = None  # weights_report(): the sidecar says which math made the output
    loop_started: float = field(default_factory=time.time)  # queue_s counts from here
    ok: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)

    def __call__(self, job: RequestJob, result: Result | None, error: str | None) -> None:
        r = job.request
        output = ""
        if result is not None:
            try:
                output = self._write(job, result)
            except Exception as exc:  # disk full, encoder error: this request fails, the job goes on
                error = f"{type(exc).__name__}: {exc}"
        if error is None:
            self.ok.append(r.id)
        else:
            self.failed[r.id] = error
            log.warning("request %s failed: %s", r.id, error)
        self.row(job, "ok" if error is None else "failed", output, error)

    def row(self, job: RequestJob, status: str, output: str = "", error: str | None = None) -> None:
        r = job.request
        timings = job.timings
        try:
            self.metrics.row(
                id=r.id,
                status=status,
                kind=r.kind,
                width=r.width,
                height=r.height,
                num_frames=r.num_frames,
                steps=r.num_inference_steps,
                guidance=r.guidance_scale,
                seed=r.seed,
                tokens=job.tokens,
                queue_s=max(0.0, job.admitted_at - self.loop_started),
                latency_s=time.perf_counter() - job.admitted_perf,
                weight_bytes=round(job.weight_bytes),
                stall_s=job.stall_s,
                rank=self.rank,
                admitted_at=iso_time(job.admitted_at),
                finished_at=iso_time(time.time()),
                output=output,
                error=error,
                **{k: timings.get(k) for k in ("prepare_s", "denoise_s", "decode_s", "write_s")},
            )
        except OSError as exc:  # a full disk must fail this row, not the rank (its peers would hang)
            log.error("request %s: cannot append its metrics row: %s", r.id, exc)

    def _write(self, job: RequestJob, result: Result) -> str:
        r = job.request
        start = time.perf_counter()
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
        job.timings["write_s"] = time.perf_counter() - start  # the media and latents; the sidecar is tiny
        sidecar = {
            "id": r.id,
            "status": "complete",
            "kind": r.kind,
            "request": r.resolved(),
            "request_hash": r.content_hash(),
            "output_key": output_key(r, self.model_identity, self.cfg.vae_tiling),
            "seed": r.seed,
            "tokens": job.tokens,
            "files": files,
            "timings": {k: round(v, 6) for k, v in job.timings.items()},
            "model": str(self.model_dir),
            "weights": self.weights,
            "versions": versions(),
        }
        outputs.write_json(paths.sidecar, sidecar)
        return paths.media.name


@record
def run_job(cfg: RunConfig) -> tuple[int, str | None]:
    """(exit code, summary line on rank 0 else None): 0 all requests ok, 1 some failed, 130 / 143 stopped
    by SIGINT / SIGTERM. Raises BadInput for exit code 2."""
    stop = StopRequest()
    restore = stop.install()  # first, so a signal during start-up also stops cleanly
    try:
        try:
            world = init_world(cfg.device, cfg.collective_timeout_s)
        except ValueError as exc:  # no such device, more ranks than GPUs
            raise BadInput(str(exc)) from exc
        try:
            return _run(cfg, world, stop)
        finally:
            teardown(world)
    finally:
        restore()


def _check_same_plan(world: World, plan: Plan) -> None:
    # Every rank planned from the same files; if they disagree (a file changed mid-start) the schedules
    # would differ: stop now on every rank rather than generate some requests twice and others never.
    digest = hashlib.sha256("".join(r.content_hash() for r in plan.requests).encode()).hexdigest()
    if len(set(world.all_gather_object(digest))) != 1:
        raise RuntimeError(
            "ranks planned different request lists (did the JSONL or --out change during start?)"
        )


def _run(cfg: RunConfig, world: World, stop: StopRequest) -> tuple[int, str | None]:
    started = time.time()
    _quiet_other_ranks(world)
    plan = plan_run(cfg)
    ids = {r.id for r in plan.requests}
    if world.is_main and (stale := outputs.remove_stale_temporaries(cfg.out, ids)):
        log.info("removed %d temporary file(s) left by an interrupted run", stale)
    _check_same_plan(world, plan)  # also the barrier after which no rank looks at stale temporaries
    log.info(
        "%d requests to generate, %d already complete%s, %d invalid",
        len(plan.requests),
        len(plan.complete),
        _preview(r.id for r in plan.complete),
        len(plan.invalid),
    )
    if not plan.requests:  # nothing to do: no weight is read, no bar is shown
        return _end(cfg, world, plan, [], started, None)
    mine = assign(plan.requests, world.world_size).queues[world.rank]
    checkpoint = Checkpoint.open(plan.model_dir)
    ctx = load_context(
        plan.model_dir,
        world.device,
        with_layers=cfg.offload is OffloadMode.RESIDENT,
        vae_tiling=cfg.vae_tiling,
        tokenizer=plan.tokenizer,
        fp8_compute=cfg.fp8_compute,
    )
    weights = build_weights(ctx.layers, checkpoint, cfg.offload, world)
    metrics = MetricsWriter(cfg.out, rank=world.rank, tag=cfg.tag)
    show = cfg.progress and world.is_main
    bar = tqdm(total=len(plan.requests), unit="output", disable=not show, dynamic_ncols=True)
    writer = ResultWriter(
        cfg,
        plan.model_dir,
        metrics,
        plan.model_identity,
        rank=world.rank,
        weights=weights_report(ctx.split.fp8),
    )
    sync = PassSync(world.world_size, world.exchange_group)
    runner = PassRunner(
        ctx,
        weights,
        cfg.max_active,
        writer,
        sync,
        bar.update,
        und_cache=cfg.und_cache,
        stop=stop,
        rule=cfg.prefill,
    )
    try:
        runner.run(mine)
        for job in runner.abandoned:  # stopped mid-denoise: on record, and redone by the next run
            writer.row(job, "interrupted", error=f"stopped by {stop.name or 'a peer rank'} mid-denoise")
    except Exception as exc:
        if world.distributed and isinstance(exc, RuntimeError | dist.DistError):
            log.error(
                "a collective failed: a peer rank died or stalled past --collective-timeout-s (%s)", exc
            )
        raise
    finally:
        bar.close()
        metrics.close()
        weights.close()
        write_passes(cfg.out, world.rank, cfg.tag, PassRecord._fields, runner.timeline)
    gathers = cfg.offload in (OffloadMode.ALLGATHER, OffloadMode.SHARDED)
    report = _rank_report(world, runner, writer, gathers)
    report["signal"] = stop.name
    report["weights"] = weights_report(ctx.split.fp8, calls=True)
    return _end(cfg, world, plan, world.all_gather_object(report), started, runner)


def _end(
    cfg: RunConfig, world: World, plan: Plan, ranks: list[dict], started: float, runner: PassRunner | None
) -> tuple[int, str | None]:
    """Metrics merged and summary.json written by rank 0 (also when stopped by a signal), then the exit
    code every rank returns."""
    failed = {k: v for report in ranks for k, v in report.pop("failed").items()}
    signals = [report.pop("signal") for report in ranks if report.get("signal")]
    interrupted = runner is not None and runner.interrupted
    if world.is_main:
        if ranks:
            merge_metrics(cfg.out)
        summary = _summary(cfg, plan, ranks, failed, time.time() - started, world)
        if interrupted:
            summary["interrupted"] = {
                "signal": signals[0] if signals else "",
                "abandoned": sorted(i for report in ranks for i in report["abandoned"]),
                "not_started": sum(report["not_started"] for report in ranks),
            }
        outputs.write_json(cfg.out / summary_name(cfg.tag), summary)
        if failed:
            log.error("%d request(s) failed: %s", len(failed), ", ".join(sorted(failed)))
    world.barrier()  # summary.json exists before any rank reports success
    line = describe_summary(cfg.out, cfg.tag) if world.is_main else None
    if interrupted:
        # The signal one rank got stopped every rank: all exit with the shell's code for it.
        code = 128 + int(getattr(signal_module, signals[0])) if signals else 130
        return code, line
    return (1 if failed else 0), line


def _preview(ids, limit: int = 8) -> str:
    """': a, b, c (+5 more)' for a log line; the full list is in summary.json."""
    ids = list(ids)
    if not ids:
        return ""
    more = f" (+{len(ids) - limit} more)" if len(ids) > limit else ""
    return ": " + ", ".join(ids[:limit]) + more


def _quiet_other_ranks(world: World) -> None:
    if not world.is_main:
        logging.getLogger("cosmos3_batch").setLevel(logging.WARNING)


def _rank_report(world: World, runner: PassRunner, writer: ResultWriter, gathers: bool) -> dict:
    totals = runner.totals
    return {
        "rank": world.rank,
        "ok": len(writer.ok),
        "failed": writer.failed,
        "passes": runner.passes,
        "und_passes": runner.und_passes,
        "pass_s": round(runner.pass_s, 6),
        "all_reduces": runner.sync.all_reduces,
        "gathers": totals.fetches if world.distributed and gathers else 0,
        "fetches": totals.fetches,
        "collective_trace": runner.sync.trace_digest,
        "abandoned": [job.request.id for job in runner.abandoned],
        "not_started": len(runner.not_started),
        "h2d_bytes": totals.h2d_bytes,
        "gathered_bytes": totals.gathered_bytes,
        "stall_s": round(totals.stall_s, 6),
        "collective_s": round(totals.collective_s, 6),
        "compute_s": round(totals.compute_s, 6),
        "h2d_s": round(totals.h2d_s, 6),
        "stall_share": round(totals.stall_share, 6),
        "und_runs": runner.und_runs,
        # Requests active per pass, summed: / (passes x max_active) is the mean slot occupancy.
        "active_sum": sum(record.active for record in runner.timeline),
    }


def _summary(cfg: RunConfig, plan: Plan, ranks: list[dict], failed: dict, wall: float, world: World) -> dict:
    ok = sum(report["ok"] for report in ranks)
    return {
        "requests_in_file": len(plan.requests) + len(plan.complete) + len(plan.invalid),
        "generated_ok": ok,
        "failed": [{"id": k, "error": v} for k, v in sorted(failed.items())],
        "skipped_complete": len(plan.complete),
        "skipped_complete_ids": sorted(r.id for r in plan.complete),
        "invalid": [{"line": e.line, "field": e.field, "error": e.message} for e in plan.invalid],
        "started_at": iso_time(time.time() - wall),
        "wall_s": round(wall, 3),
        "outputs_per_minute": round(60 * ok / wall, 3) if wall > 0 else None,
        "ranks": ranks,
        "config": {
            "prompts": str(cfg.prompts.resolve()),
            "model": str(plan.model_dir),
            "max_active": cfg.max_active,
            "offload": cfg.offload.value,
            "world_size": world.world_size,
            "device": str(world.device),
        },
        "versions": versions(),
    }


def summary_name(tag: str) -> str:
    return f"summary.{tag}.json" if tag else "summary.json"


def describe_summary(out: Path, tag: str = "") -> str:
    summary = json.loads((out / summary_name(tag)).read_text())
    line = (
        f"{summary['generated_ok']} generated, {len(summary['failed'])} failed, "
        f"{summary['skipped_complete']} already complete, {len(summary['invalid'])} invalid -> {out}"
    )
    if stopped := summary.get("interrupted"):
        left = len(stopped["abandoned"]) + stopped["not_started"]
        line = (
            f"stopped by {stopped['signal'] or 'a signal'}: {line}; {left} not generated "
            "(rerun the same command to resume)"
        )
    return line
