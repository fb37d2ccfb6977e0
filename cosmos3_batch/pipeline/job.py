"""One `run`: validate everything, load the model, run the passes, write outputs, metrics and summary.

Order matters for users: every check that can fail on bad input (request file, token counts, --out,
checkpoint layout) runs before any weight is read, and raises `BadInput` (exit code 2).
"""

from __future__ import annotations

import hashlib
import logging
import signal as signal_module
import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from tqdm import tqdm

from cosmos3_batch.checkpoint.folder import Checkpoint, CheckpointError
from cosmos3_batch.config import RunConfig
from cosmos3_batch.engine.transport import OffloadMode
from cosmos3_batch.io import outputs
from cosmos3_batch.io.metrics import MetricsWriter, merge_metrics, state_dir, write_passes
from cosmos3_batch.model.limits import limits_for
from cosmos3_batch.model.loading import validate_checkpoint
from cosmos3_batch.model.numerics import warn_unless_strict
from cosmos3_batch.model.prompts import build_helper, load_tokenizer, tokenize
from cosmos3_batch.parallel.seq_group import build_seq_group
from cosmos3_batch.parallel.sequence import check_model, check_world, spans_nodes
from cosmos3_batch.parallel.world import World, init_world, teardown
from cosmos3_batch.pipeline.context import load_context
from cosmos3_batch.pipeline.job_plan import Plan
from cosmos3_batch.pipeline.results import ResultWriter, output_key
from cosmos3_batch.pipeline.runner import PassRecord, PassRunner, PassSync
from cosmos3_batch.pipeline.stop import StopRequest
from cosmos3_batch.pipeline.summary import build_summary, describe_summary, preview, rank_report, summary_name
from cosmos3_batch.pipeline.weights import build_weights, weights_report
from cosmos3_batch.plan.schedule import assign, in_shard
from cosmos3_batch.requests.parse import Request, RequestError, RequestFileError, load_requests
from cosmos3_batch.requests.sources import STDIN, Columns

log = logging.getLogger("cosmos3_batch")


class BadInput(ValueError):
    """Bad requests, flags or checkpoint, found before any weight was loaded (exit code 2)."""


def token_errors(requests: list[Request], helper, model_limit: int) -> list[RequestError]:
    """Prompts are tokenized with their templates exactly as generation will; over-long ones are rejected."""
    errors: list[RequestError] = []
    seen: set[tuple[str, int]] = set()
    for r in requests:
        if (r.source, r.line) in seen:  # the other samples of a line: the same prompts
            continue
        seen.add((r.source, r.line))
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
                        source=r.source,
                        unit=r.unit,
                    )
                )
    return errors


def plan_run(cfg: RunConfig, world_size: int = 1, stdin: bytes | None = None) -> Plan:
    """`stdin`: the bytes of standard input when PROMPTS names "-" (read once, by rank 0)."""
    from cosmos3_batch.model.tiny import ensure_default_tiny

    model_dir = cfg.model if cfg.model is not None else ensure_default_tiny()
    try:
        checkpoint = Checkpoint.open(model_dir)
        validate_checkpoint(checkpoint)
        # Collect the file's problems and the token-count problems, then report them all at once.
        requests, invalid = load_requests(
            cfg.prompts,
            limits_for(checkpoint, cfg.max_vision_tokens),
            skip_invalid=True,
            samples=cfg.samples_per_prompt,
            columns=Columns(cfg.prompt_column, cfg.id_column),
            stdin=stdin,
        )
    except (CheckpointError, RequestFileError) as exc:
        raise BadInput(str(exc)) from exc
    try:  # --sp must fit the model's heads (named first: the fix is in the model) and the ranks
        check_model(cfg.sp, checkpoint.config("transformer"))
        check_world(cfg.sp, world_size)
    except ValueError as exc:
        raise BadInput(str(exc)) from exc
    tokenizer = load_tokenizer(checkpoint)
    helper = build_helper(checkpoint, tokenizer)  # on meta modules: no weights are read
    errors = token_errors(requests, helper, int(getattr(tokenizer, "model_max_length", 1 << 30)))
    invalid = invalid + errors
    if invalid and not cfg.skip_invalid:
        raise BadInput(str(RequestFileError(", ".join(cfg.prompts), invalid)))
    try:  # after the file checks: a bad file leaves no --out folder behind
        outputs.check_writable(cfg.out)
    except ValueError as exc:
        raise BadInput(str(exc)) from exc
    bad_lines = {(e.source, e.line) for e in errors}
    requests = [r for r in requests if (r.source, r.line) not in bad_lines]
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
        done, why = outputs.is_complete(paths, r.content_hash(), key, cfg.save_latents, outputs.mode_files(r))
        if done and not cfg.overwrite:
            complete.append(r)
            continue
        if paths.sidecar.exists() and not cfg.overwrite:
            log.warning("%s: %s; generating it again", r.id, why)
        todo.append(r)
    return Plan(Path(model_dir), todo, invalid, complete, tokenizer, identity)


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
    stdin = None
    if STDIN in cfg.prompts:  # rank 0 reads it; under torchrun the others must not race it for the bytes
        stdin = world.all_gather_object(sys.stdin.buffer.read() if world.is_main else None)[0]
    plan = plan_run(cfg, world.world_size, stdin)  # also checks --sp against the heads and the ranks
    groups = world.world_size // cfg.sp
    ids = {r.id for r in plan.requests}
    if world.is_main:
        state_dir(cfg.out)  # the bookkeeping folder, made by one rank before the ranks meet
        if stale := outputs.remove_stale_temporaries(cfg.out, ids):
            log.info("removed %d temporary file(s) left by an interrupted run", stale)
    _check_same_plan(world, plan)  # also the barrier after which no rank looks at stale temporaries
    log.info(
        "%d requests to generate, %d already complete%s, %d invalid",
        len(plan.requests),
        len(plan.complete),
        preview(r.id for r in plan.complete),
        len(plan.invalid),
    )
    if not plan.requests:  # nothing to do: no weight is read, no bar is shown
        return _end(cfg, world, plan, [], started, None)
    try:
        outputs.pin_encoder()
    except RuntimeError as exc:  # no ffmpeg at all: every video would fail after its whole denoise
        raise BadInput(f"cannot encode MP4/AAC outputs: {exc}") from exc
    # --sp: the groups are the ranks of the schedule; every rank of a group gets the group's queue.
    mine = assign(plan.requests, groups).queues[world.rank // cfg.sp]
    seq_group = build_seq_group(world.rank, world.world_size, cfg.sp, world.device, cfg.collective_timeout_s)
    if world.is_main and spans_nodes(cfg.sp, world.local_world_size):
        log.warning(
            "--sp %d does not divide the %d ranks per node: some groups' all-to-alls cross nodes",
            cfg.sp, world.local_world_size,
        )  # fmt: skip
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
    bar = Progress(tqdm(total=len(plan.requests), unit="output", disable=not show, dynamic_ncols=True))
    writer = ResultWriter(
        cfg,
        plan.model_dir,
        metrics,
        plan.model_identity,
        rank=world.rank,
        weights=weights_report(ctx.split.fp8),
    )
    sync = PassSync(world.world_size, world.exchange_group)
    if world.is_main and world.device.type == "cpu" and (cfg.sp > 1 or cfg.batch_branches):
        # Their exactness rests on the BLAS computing a row alike whatever rows share its GEMM (numerics.py).
        warn_unless_strict(f"--sp {cfg.sp}" if cfg.sp > 1 else "batched branches")
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
        batch_branches=cfg.batch_branches,
        sp=seq_group,
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
    except BaseException:
        bar.close()
        raise
    finally:
        metrics.close()
        weights.close()
        write_passes(cfg.out, world.rank, cfg.tag, PassRecord._fields, runner.timeline)
    gathers = cfg.offload in (OffloadMode.ALLGATHER, OffloadMode.SHARDED)
    report = rank_report(world, runner, writer, gathers)
    report["signal"] = stop.name
    report["weights"] = weights_report(ctx.split.fp8, calls=True)
    ranks = world.all_gather_object(report)
    # Peers' outputs written after the last exchange reach rank 0's bar only now.
    bar.update(sum(r["ok"] + len(r["failed"]) for r in ranks) - bar.bar.n)
    bar.close()
    return _end(cfg, world, plan, ranks, started, runner)


class Progress:
    """The bar, updated from the loop (peers' counts) and the finisher thread (our own): one at a time."""

    def __init__(self, bar: tqdm):
        self.bar = bar
        self._lock = threading.Lock()

    def update(self, n: int) -> None:
        if n > 0:
            with self._lock:
                self.bar.update(n)

    def close(self) -> None:
        with self._lock:
            self.bar.close()


def _end(
    cfg: RunConfig, world: World, plan: Plan, ranks: list[dict], started: float, runner: PassRunner | None
) -> tuple[int, str | None]:
    """Metrics merged and summary.json written by rank 0 (also when stopped by a signal), then the exit
    code every rank returns."""
    failed = {k: v for report in ranks for k, v in report.pop("failed").items()}
    signals = [s for s in (report.pop("signal") for report in ranks) if s]
    interrupted = runner is not None and runner.interrupted
    if world.is_main:
        if ranks:
            merge_metrics(cfg.out)
        summary = build_summary(cfg, plan, ranks, failed, time.time() - started, world)
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


def _quiet_other_ranks(world: World) -> None:
    if not world.is_main:
        logging.getLogger("cosmos3_batch").setLevel(logging.WARNING)
