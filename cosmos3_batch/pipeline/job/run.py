"""One `run`: validate everything, load the model, run the passes, write outputs, metrics and summary.

Order matters for users: every check that can fail on bad input (request file, token counts, --out,
checkpoint layout, room on --out) runs before any weight is read, and raises `BadInput` (exit code 2).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record
from tqdm import tqdm

from cosmos3_batch import startup
from cosmos3_batch.checkpoint.folder import Checkpoint, CheckpointError
from cosmos3_batch.checkpoint.guardrail_cache import GuardrailRefusal
from cosmos3_batch.config import RunConfig
from cosmos3_batch.engine.transport import OffloadMode
from cosmos3_batch.io import dataset, outputs
from cosmos3_batch.io.ffmpeg import pin_encoder
from cosmos3_batch.io.metrics import MetricsWriter, state_dir
from cosmos3_batch.io.space import check_room, output_bytes
from cosmos3_batch.io.upsampled import UpsampleStore
from cosmos3_batch.model.limits import limits_for
from cosmos3_batch.model.loading import import_model_classes, validate_checkpoint
from cosmos3_batch.model.numerics import warn_unless_strict
from cosmos3_batch.model.prompts import build_helper, load_tokenizer
from cosmos3_batch.model.vae_shards import check_patchable
from cosmos3_batch.parallel.exit_codes import ExitCode, after_rank_0, exit_as_one
from cosmos3_batch.parallel.sequence import check_model, check_world
from cosmos3_batch.parallel.stall import Place, peer_failure, post_mortem
from cosmos3_batch.parallel.stop import StopRequest
from cosmos3_batch.parallel.vae_group import GroupBroken
from cosmos3_batch.parallel.world import World, init_world, teardown
from cosmos3_batch.pipeline.finish.guardrail import Guardrails
from cosmos3_batch.pipeline.finish.results import ResultWriter, shard_writer
from cosmos3_batch.pipeline.job.drive import Progress, drive
from cosmos3_batch.pipeline.job.dtypes import check_dtypes, compute_tag
from cosmos3_batch.pipeline.job.ending import Outcome, end_run
from cosmos3_batch.pipeline.job.load import Loaded, load_model
from cosmos3_batch.pipeline.job.resume import prepare_out, share_split, split_complete
from cosmos3_batch.pipeline.job.run_plan import Plan
from cosmos3_batch.pipeline.job.screen import guardrails_on, screen
from cosmos3_batch.pipeline.job.sizing import device_memory, size_run, smallest
from cosmos3_batch.pipeline.job.summary import describe_invalid, preview, rank_report
from cosmos3_batch.pipeline.passes.monitor import JobMonitor, final_counts, start_monitor
from cosmos3_batch.pipeline.passes.runner import PassRunner
from cosmos3_batch.pipeline.passes.weights import weights_report
from cosmos3_batch.plan.cache import check_cache
from cosmos3_batch.plan.schedule import assign, in_shard
from cosmos3_batch.plan.validate import model_limit, token_errors
from cosmos3_batch.requests.parse import Request, RequestFileError, by_request, load_requests
from cosmos3_batch.requests.sources import STDIN, Columns

log = logging.getLogger("cosmos3_batch")


class BadInput(ValueError):
    """Bad requests, flags or checkpoint, found before any weight was loaded (exit code 2)."""


def check_chained(cfg: RunConfig, requests: list) -> None:
    """Upsampling and captions run on one rank per request: not yet inside an --sp or VAE group."""
    if any(r.upsample or r.captions for r in requests) and (cfg.sp > 1 or cfg.vae_patch_parallel_size > 1):
        raise ValueError("upsample / caption / score: not with --sp or --vae-patch-parallel-size above 1 yet")


def plan_run(cfg: RunConfig, world_size: int = 1, stdin: bytes | None = None, resume: bool = True) -> Plan:
    """`stdin`: the bytes of standard input when PROMPTS names "-" (read once, by rank 0). `resume=False`
    (ranks other than 0): OUT is neither read nor checked and nothing is tokenized: the plan holds all of
    this job's requests, and `resume.share_split` splits them as rank 0 did."""
    from cosmos3_batch.model.tiny import ensure_default_tiny

    model_dir = cfg.model if cfg.model is not None else ensure_default_tiny()
    try:
        checkpoint = Checkpoint.open(model_dir)
        validate_checkpoint(checkpoint)
        guardrails = guardrails_on(cfg, model_dir)  # their models in the cache, else exit 2 now
        # Collect the file's problems and the token-count problems, then report them all at once.
        requests, invalid = load_requests(
            cfg.prompts,
            replace(limits_for(checkpoint, cfg.max_vision_tokens), guardrails=guardrails, chain=cfg.chain),
            skip_invalid=True,
            samples=cfg.samples_per_prompt,
            columns=Columns(cfg.prompt_column, cfg.id_column),
            stdin=stdin,
            input_format=cfg.input_format,
        )
    except (GuardrailRefusal, CheckpointError, RequestFileError) as exc:
        raise BadInput(str(exc)) from exc
    try:  # --sp must fit the model's heads (named first: the fix is in the model) and the ranks
        check_model(cfg.sp, checkpoint.config("transformer"))
        check_world(cfg.sp, world_size)
        check_patchable(checkpoint.config("vae"), cfg.vae_patch_parallel_size)
        check_dtypes(cfg, checkpoint)
        check_cache(cfg.cache, requests)
        check_chained(cfg, requests)
    except ValueError as exc:
        raise BadInput(str(exc)) from exc
    tokenizer = load_tokenizer(checkpoint)
    helper = build_helper(checkpoint, tokenizer)  # on meta modules: no weights are read
    try:  # decided on the whole input, so every array task of the job decides alike
        held = dataset.choose(cfg.out, cfg.format, cfg.layout, len(requests))
    except ValueError as exc:
        raise BadInput(str(exc)) from exc
    mine = requests if cfg.shard is None else [r for r in requests if in_shard(r.id, *cfg.shard)]
    identity = checkpoint.identity() + compute_tag(cfg, checkpoint) + ("+guardrails" if guardrails else "")
    if not resume:
        return Plan(Path(model_dir), mine, invalid, [], tokenizer, identity, held, guardrails)
    todo, complete = split_complete(cfg, mine, identity, held)
    # Complete outputs were made from these very prompts by this model: their tokens need no second look
    # (at 100k complete requests, tokenizing them was most of a rerun's start-up).
    done = {r.id for r in complete}
    errors = token_errors([r for r in requests if r.id not in done], helper, model_limit(tokenizer))
    invalid = invalid + errors
    if invalid and not cfg.skip_invalid:
        raise BadInput(str(RequestFileError(", ".join(cfg.prompts), invalid)))
    try:  # after the file checks: a bad file leaves no --out folder behind
        outputs.check_writable(cfg.out)
    except ValueError as exc:
        raise BadInput(str(exc)) from exc
    bad_lines = {(e.source, e.line) for e in errors}
    todo = [r for r in todo if (r.source, r.line) not in bad_lines]
    if todo:  # a job that could not write even its largest output must not start
        try:
            size = _output_size(cfg, checkpoint)
            largest = max(todo, key=size)
            check_room(cfg.out, size(largest), f"request {largest.id!r}")
        except ValueError as exc:
            raise BadInput(str(exc)) from exc
    return Plan(Path(model_dir), todo, invalid, complete, tokenizer, identity, held, guardrails)


def run_job(cfg: RunConfig) -> Outcome:
    """The exit code (the same on every rank: parallel/exit_codes.py), the summary line on rank 0, and an
    error line for the rank that prints it. Expected outcomes (bad input, a stop) return; only a crash
    raises, and only a crash leaves torchelastic an error file (the launcher prints its traceback)."""
    stop = StopRequest()
    restore = stop.install()  # first, so a signal during start-up also stops cleanly
    outcome = None
    try:
        outcome = _recorded(cfg, stop)
        return outcome
    finally:
        if outcome is not None and "TORCHELASTIC_RUN_ID" in os.environ:
            # Done, and every rank agreed: torchrun's agent SIGTERMs the ranks still exiting once the first
            # has left with a non-zero code; they leave with the same code instead of dying of the signal.
            exit_as_one(outcome.code)
        else:
            restore()


@record
def _recorded(cfg: RunConfig, stop: StopRequest) -> Outcome:
    try:
        world = init_world(cfg.device, cfg.collective_timeout_s)
    except ValueError as exc:  # no such device, more ranks than GPUs: found before the ranks meet
        return Outcome(ExitCode.BAD_INPUT, None, after_rank_0(str(exc)))
    place = Place(timeout_s=cfg.collective_timeout_s)
    try:
        try:
            return _run(cfg, world, stop, place)
        except BadInput as exc:  # raised on every rank (`_agreed`): one of them says it
            return Outcome(ExitCode.BAD_INPUT, None, str(exc) if world.is_main else None)
        except Exception as exc:
            if not world.distributed or (kind := peer_failure(exc, place.timeout_s)) is None:
                raise  # a crash of our own: torchelastic's error file and the traceback
            return _peer_lost(world, kind, place, exc, stop)
    finally:
        teardown(world)


def _peer_lost(world: World, kind: str, place: Place, exc: Exception, stop: StopRequest) -> Outcome:
    """A collective failed because a peer stalled or died: exit 69 on every survivor, one line from one.
    A stop signal during the survivors' meeting ends it: the launcher is tearing the job down."""
    place.vae = isinstance(exc, GroupBroken)
    log.debug("collective failed on rank %d: %s", world.rank, exc)
    verdict = post_mortem(world.rank, world.world_size, kind, place, stopping=lambda: stop.signum is not None)
    return Outcome(ExitCode.PEER, None, verdict.line if verdict.speaker else None)


def _output_size(cfg: RunConfig, checkpoint: Checkpoint):
    """request -> about how many bytes its outputs take (io/space.py), the VAE's factors read once."""
    vae = checkpoint.config("vae")
    channels = int(vae.get("z_dim", 48))
    spatial, temporal = int(vae.get("scale_factor_spatial", 16)), int(vae.get("scale_factor_temporal", 4))
    return lambda r: output_bytes(r, cfg.save_latents, channels, spatial, temporal)


def _check_same_plan(world: World, plan: Plan) -> int | None:
    """Every rank planned from the same files; if they disagree (a file changed mid-start) the schedules
    would differ: stop now on every rank rather than generate some requests twice and others never. The same
    gather carries each rank's device memory: the smallest is what the job sizes the reasoner from."""
    digest = hashlib.sha256("".join(r.content_hash() for r in plan.requests).encode()).hexdigest()
    gathered = world.all_gather_object((digest, device_memory(world.device)))
    if len({d for d, _ in gathered}) != 1:
        raise RuntimeError(
            "ranks planned different request lists (did the JSONL or --out change during start?)"
        )
    return smallest([figure for _, figure in gathered])


def _run(cfg: RunConfig, world: World, stop: StopRequest, place: Place) -> Outcome:
    """The phases of a run: validate and plan (every rank alike), load, run the passes, end."""
    started = time.time()
    _quiet_other_ranks(world)
    # Rank 0's live figures (--metrics-textfile) from the first second, phase by phase.
    monitor = start_monitor(cfg, world.world_size, started) if world.is_main else None
    final = None
    try:
        plan, device_bytes = _plan_everywhere(cfg, world)
        if not plan.requests:  # nothing to do: no weight is read, no bar is shown
            if monitor is not None:
                monitor.counts(0, len(plan.complete))
            _phase(monitor, "ending")
            return end_run(cfg, world, plan, [], started)
        _agreed(world, _pin_encoder)
        cfg, plan.sizing = size_run(cfg, world, plan, device_bytes)  # the same on every rank (job/sizing.py)
        # --sp: the groups are the ranks of the schedule; every rank of a group gets the group's queue.
        mine = assign(plan.requests, world.world_size // cfg.sp).queues[world.rank // cfg.sp]
        _phase(monitor, "loading")
        import_model_classes()
        startup.imports_done()  # the collector, paused at process entry, from here on (startup.py)
        loaded = load_model(cfg, world, plan, place)
        place.enter("passes", cfg.collective_timeout_s, "--collective-timeout-s")
        ranks = _passes(cfg, world, plan, loaded, mine, stop, monitor)
        final = final_counts(ranks)
        _phase(monitor, "ending")
        return end_run(cfg, world, plan, ranks, started)
    finally:
        if monitor is not None:  # also when a peer stalled or the input was bad: the job no longer runs
            monitor.close(final)


def _phase(monitor: JobMonitor | None, name: str) -> None:
    if monitor is not None:
        monitor.phase(name)


def _passes(
    cfg: RunConfig, world: World, plan: Plan, loaded: Loaded, mine: list[Request], stop: StopRequest, monitor
) -> list[dict]:
    """This rank's queue through the pass loop; every rank's report, gathered."""
    show = cfg.progress and world.is_main
    bar = Progress(tqdm(total=len(plan.requests), unit="output", disable=not show, dynamic_ncols=True))
    guard = Guardrails(world.device) if plan.guardrails else None  # once per rank, on its device
    writer = _writer(cfg, world, plan, loaded, stop, guard)
    mine = screen(guard, cfg, world, mine, writer)  # blocked prompts are recorded, never admitted
    if monitor is not None:  # the lag warnings, and --metrics-textfile, from the exchange from now on
        monitor.attach(loaded.sync, len(plan.requests), len(plan.complete))
    if world.is_main and world.device.type == "cpu" and (cfg.sp > 1 or cfg.batch_branches):
        # Their exactness rests on the BLAS computing a row alike whatever rows share its GEMM (numerics.py).
        warn_unless_strict(f"--sp {cfg.sp}" if cfg.sp > 1 else "batched branches")
    runner = _runner(cfg, loaded, writer, bar, stop, monitor)
    if monitor is not None:
        monitor.passes = lambda: (runner.passes, runner.und_passes)
    drive(cfg, world, runner, mine, writer, bar, stop)
    gathers = cfg.offload in (OffloadMode.ALLGATHER, OffloadMode.SHARDED)
    report = rank_report(world, runner, writer, gathers)
    report["stop"] = stop.record()
    report["weights"] = weights_report(loaded.ctx.split.fp8, calls=True)
    ranks = world.all_gather_object(report)
    # Peers' outputs written after the last exchange reach rank 0's bar only now.
    bar.update(sum(r["ok"] + len(r["failed"]) + len(r["blocked"]) for r in ranks) - bar.bar.n)
    bar.close()
    return ranks


def _writer(
    cfg: RunConfig, world: World, plan: Plan, loaded: Loaded, stop: StopRequest, guard
) -> ResultWriter:
    writer = ResultWriter(
        cfg,
        plan.model_dir,
        MetricsWriter(cfg.out, rank=world.rank, tag=cfg.tag),
        plan.model_identity,
        rank=world.rank,
        weights=weights_report(loaded.ctx.split.fp8),
        stop=stop,
        layout=plan.dataset.layout,
        shards=shard_writer(cfg, plan.dataset, world.rank),
        guard=guard,
        guardrails=plan.guardrails,
    )
    if world.is_main and (recovered := writer.recover_rows(plan.complete)):
        log.info("%d complete output(s) had no metrics row (a crash or full disk): recovered", recovered)
    return writer


def _runner(cfg: RunConfig, loaded: Loaded, writer: ResultWriter, bar: Progress, stop: StopRequest, monitor):
    return PassRunner(
        loaded.ctx,
        loaded.weights,
        cfg.max_active,
        writer,
        loaded.sync,
        bar.update,
        und_cache=cfg.und_cache,
        stop=stop,
        rule=cfg.prefill,
        batch_branches=cfg.batch_branches,
        sp=loaded.seq_group,
        watch=loaded.watch.changed,
        max_batch_rows=cfg.max_batch_rows,
        on_exchange=None if monitor is None else monitor.on_exchange,
        failures=lambda: len(writer.failed),
        cache=cfg.cache,
        upsampled=UpsampleStore(cfg.out, writer.model_identity),  # read only for upsampled requests
        text_check=None if writer.guard is None else writer.guard.text,  # upsampled prompts, where guarded
        max_reason_active=cfg.max_reason_active,
    )


def _plan_everywhere(cfg: RunConfig, world: World) -> tuple[Plan, int | None]:
    """The same plan on every rank (checked), the bookkeeping folder made and stale temporaries removed; and
    the device memory the job sizes the reasoner from (`_check_same_plan`)."""
    stdin = None
    if STDIN in cfg.prompts:  # rank 0 reads it; under torchrun the others must not race it for the bytes
        stdin = world.all_gather_object(sys.stdin.buffer.read() if world.is_main else None)[0]
    # Also checks --sp against the heads and the ranks; rank 0 also --out and its room (a live figure).
    plan = _agreed(world, lambda: plan_run(cfg, world.world_size, stdin, resume=world.is_main))
    plan = share_split(world, plan)
    if world.is_main:
        state_dir(cfg.out)  # the bookkeeping folder, made by one rank before the ranks meet
        if stale := prepare_out(cfg, plan.dataset, plan.requests):
            log.info("removed %d temporary file(s) left by an interrupted run", stale)
    device_bytes = _check_same_plan(world, plan)  # also the barrier after which no rank looks at temporaries
    log.info(
        "%d requests to generate, %d already complete%s, %d invalid",
        len(plan.requests),
        len(plan.complete),
        preview(r.id for r in plan.complete),
        len(by_request(plan.invalid)),  # requests, not errors: a line with two errors is one
    )
    if plan.invalid and world.is_main:
        log.warning("skipped (--skip-invalid):\n%s", describe_invalid(plan.invalid))
    return plan, device_bytes


def _agreed(world: World, step):
    """`step()` on every rank; BadInput on every rank if it raised BadInput on any (its first message).

    What one rank finds may differ from what another does (free space on --out, ffmpeg on a node): the
    ranks must still leave together, before the first collective that the others would wait in."""
    try:
        result, problem = step(), None
    except BadInput as exc:
        result, problem = None, str(exc)
    problems = [p for p in world.all_gather_object(problem) if p]
    if problems:
        raise BadInput(problems[0])
    return result


def _pin_encoder() -> None:
    try:
        pin_encoder()
    except RuntimeError as exc:  # no ffmpeg at all: every video would fail after its whole denoise
        raise BadInput(f"cannot encode MP4/AAC outputs: {exc}") from exc


def _quiet_other_ranks(world: World) -> None:
    if not world.is_main:
        logging.getLogger("cosmos3_batch").setLevel(logging.WARNING)
