"""Resume (DESIGN.md §6, §12): which requests an earlier run already completed, in the dataset's format
(found by rank 0 and handed to the other ranks).

`files`: each request's sidecar and the files it lists (flat or nested layout). `webdataset`: the indexes
of the finalized shards, one small file per shard, never the members.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from cosmos3_batch.config import RunConfig
from cosmos3_batch.io import outputs
from cosmos3_batch.io.dataset import Dataset, write_record
from cosmos3_batch.io.manifest import recorded_sidecars
from cosmos3_batch.io.shard_index import (
    finish_renames,
    latest_samples,
    read_indexes,
    remove_stale,
    sample_complete,
)
from cosmos3_batch.parallel.world import World
from cosmos3_batch.pipeline.finish.blocked import NOT_COMPLETE, is_blocked
from cosmos3_batch.pipeline.finish.results import output_key
from cosmos3_batch.pipeline.job.run_plan import Plan
from cosmos3_batch.requests.parse import Request

log = logging.getLogger("cosmos3_batch")


def split_complete(
    cfg: RunConfig, requests: list[Request], identity: str, dataset: Dataset
) -> tuple[list[Request], list[Request]]:
    """(to generate, already complete); with --overwrite everything is generated again."""
    shards = dataset.format == "webdataset"
    if shards:  # a shard whose rename a kill interrupted counts: its samples are not generated again
        finish_renames(cfg.out, cfg.tag)
    located = latest_samples(read_indexes(cfg.out)) if shards else {}
    recorded = {} if shards or cfg.overwrite else recorded_sidecars(cfg.out)
    todo, complete = [], []
    for r in requests:
        content = r.content_hash()
        key = output_key(r, identity, cfg.vae_tiling, content)
        if shards:
            found = located.get(r.id)
            done, why = sample_complete(found, r, content, key, cfg.save_latents)
            seen, unrecorded = found is not None, found is None
        else:
            paths = outputs.paths_for(cfg.out, r.id, r.num_frames, dataset.layout)
            required = outputs.mode_files(r)
            latents = cfg.save_latents and r.reason is None  # a reasoner's text has none to save
            done, why = outputs.is_complete(paths, content, key, latents, required, recorded.get(r.id))
            seen, unrecorded = not done and paths.sidecar.exists(), why == NOT_COMPLETE
        if not done and unrecorded and _was_blocked(cfg, r, dataset, content, key):
            done, seen = True, False  # blocked by the guardrails: an outcome, not retried
        if done and not cfg.overwrite:
            complete.append(r)
            continue
        if seen and not done and not cfg.overwrite:
            log.warning("%s: %s; generating it again", r.id, why)
        todo.append(r)
    return todo, complete


def _was_blocked(cfg: RunConfig, r: Request, dataset: Dataset, content: str, key: str) -> bool:
    """An earlier run's guardrails blocked this very request (its sidecar says so: finish/blocked.py)."""
    return is_blocked(outputs.paths_for(cfg.out, r.id, r.num_frames, dataset.layout).sidecar, content, key)


def share_split(world: World, plan: Plan) -> Plan:
    """Rank 0 alone read OUT for resume (every shard index or sidecar: once, not once per rank) and tokenized
    what is left (`plan_run(resume=True)`); one broadcast hands its split to the other ranks, whose plans
    hold all of the job's requests (`job._check_same_plan` then compares the results)."""
    if not world.distributed:
        return plan
    split = None
    if world.is_main:  # ids hold no newline (requests/fields.py): one string each, not a million objects
        split = ("\n".join(r.id for r in plan.requests), "\n".join(r.id for r in plan.complete), plan.invalid)
    todo, complete, invalid = world.broadcast_object(split)
    if world.is_main:
        return plan
    todo, complete = set(todo.split("\n")), set(complete.split("\n"))
    mine = plan.requests
    return replace(
        plan, requests=[r for r in mine if r.id in todo], complete=[r for r in mine if r.id in complete],
        invalid=invalid,
    )  # fmt: skip


def prepare_out(cfg: RunConfig, held: Dataset, requests: list[Request]) -> int:
    """Rank 0, before the ranks meet: record the dataset's format and layout, and remove what killed
    writers of these requests left (temporaries; under webdataset, this tag's open shards and staging)."""
    write_record(cfg.out, held)
    stale = outputs.remove_stale_temporaries(cfg.out, {r.id for r in requests}, held.layout)
    if held.format == "webdataset":
        stale += remove_stale(cfg.out, cfg.tag)
    return stale
