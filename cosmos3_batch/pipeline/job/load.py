"""The load phase of a run: the process groups, the model context, the layer weights (resident or through the
DLO engine), and the two waits for every rank's cold read. Runs after every input was validated."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from cosmos3_batch.checkpoint.folder import Checkpoint
from cosmos3_batch.checkpoint.watch import CheckpointWatch
from cosmos3_batch.config import RunConfig
from cosmos3_batch.engine.transport import OffloadMode
from cosmos3_batch.model.loading import transformer_rule
from cosmos3_batch.parallel.seq_group import SeqGroup, build_seq_group
from cosmos3_batch.parallel.sequence import spans_nodes
from cosmos3_batch.parallel.stall import Place
from cosmos3_batch.parallel.vae_group import build_decode_group
from cosmos3_batch.parallel.world import World
from cosmos3_batch.pipeline.finish.vae_team import build_team
from cosmos3_batch.pipeline.job.run_plan import Plan
from cosmos3_batch.pipeline.kinds.context import ModelContext, load_context
from cosmos3_batch.pipeline.passes.exchange import PassSync
from cosmos3_batch.pipeline.passes.weights import build_weights

log = logging.getLogger("cosmos3_batch")


@dataclass
class Loaded:
    """What the pass loop runs on, once every rank holds its part of the model."""

    ctx: ModelContext
    weights: object  # ResidentWeights or OffloadedWeights (passes/weights.py)
    sync: PassSync
    seq_group: SeqGroup | None
    watch: CheckpointWatch  # the checkpoint's files as this job loaded them


def load_model(cfg: RunConfig, world: World, plan: Plan, place: Place) -> Loaded:
    seq_group = build_seq_group(world.rank, world.world_size, cfg.sp, world.device, cfg.collective_timeout_s)
    parts = cfg.vae_patch_parallel_size
    decode_group = build_decode_group(
        world.rank, world.world_size, cfg.sp, parts, world.device, cfg.collective_timeout_s
    )
    if decode_group is not None:  # its connections made now, by every member at this same point
        decode_group.warm_up()
    if world.is_main and spans_nodes(cfg.sp, world.local_world_size):
        log.warning(
            "--sp %d does not divide the %d ranks per node: some groups' all-to-alls cross nodes",
            cfg.sp, world.local_world_size,
        )  # fmt: skip
    watch = CheckpointWatch(plan.model_dir)  # before any weight is read: the files as this job loads them
    checkpoint = Checkpoint.open(plan.model_dir)
    ctx = load_context(
        plan.model_dir,
        world.device,
        with_layers=cfg.offload is OffloadMode.RESIDENT,
        vae_tiling=cfg.vae_tiling,
        tokenizer=plan.tokenizer,
        fp8_compute=cfg.fp8_compute,
        dtype=cfg.dtype,
        vae_dtype=cfg.vae_dtype,
    )
    ctx.vae_team = build_team(ctx, parts, seq_group, decode_group)
    if any(r.reason or r.upsample or r.captions for r in plan.requests):  # the ViT, lm_head, processor
        from cosmos3_batch.model.reasoner import Reasoner

        ctx.reasoner = Reasoner(checkpoint, ctx.split.transformer, world.device)
    # Loading has no collective; the first ones after it (the layout digest, the shard reads' end) wait with
    # --load-timeout-s for the slowest rank's cold read, not with the pass loop's --collective-timeout-s.
    place.enter("loading", cfg.load_timeout_s, "--load-timeout-s")
    world.wait_for_ranks(cfg.load_timeout_s, "loading")
    sync = PassSync(world.world_size, world.exchange_group, place, rank=world.rank)
    rule = transformer_rule(checkpoint, cfg.dtype)
    weights = build_weights(ctx.layers, checkpoint, cfg.offload, world, rule, sync.waiting, cfg.und_resident)
    place.enter("reading the shards")
    world.wait_for_ranks(cfg.load_timeout_s, "reading the shards")
    return Loaded(ctx, weights, sync, seq_group, watch)
