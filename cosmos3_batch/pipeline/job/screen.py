"""Guardrails in a job (DESIGN.md §23, docs/guardrails.md): on or off; the prompts checked before admission.

On by default for real checkpoints, off for the folders make-tiny writes (the built-in tiny and demo models:
nothing is downloaded, ever); `--guardrails` / `--no-guardrails` decide for any checkpoint. On, with its
package or models missing, is exit 2 before anything loads (checkpoint/guardrail_cache.py), never a job that
runs unchecked. Each rank checks its own queue's prompts before its first pass; a blocked request is recorded
(finish/blocked.py) and never admitted. No collective depends on a decision: a rank whose requests are all
blocked takes part in every pass with nothing active, as a rank with an empty queue does. A guarded job's
model identity ends in "+guardrails" (`plan_run`): its outputs differ (faces pixelated), so switching
regenerates them.
"""

from __future__ import annotations

from pathlib import Path

from cosmos3_batch.checkpoint.guardrail_cache import GuardrailRefusal, refusal, written_by_make_tiny
from cosmos3_batch.config import RunConfig
from cosmos3_batch.parallel.world import World
from cosmos3_batch.pipeline.finish.guardrail import Guardrails
from cosmos3_batch.pipeline.finish.results import ResultWriter
from cosmos3_batch.requests.parse import Request


def guardrails_on(cfg: RunConfig, model_dir: Path) -> bool:
    """Whether this job runs the guardrails; GuardrailRefusal (exit 2, nothing loaded) if they cannot run."""
    on = cfg.guardrails if cfg.guardrails is not None else not written_by_make_tiny(model_dir)
    if on and (why := refusal()) is not None:
        raise GuardrailRefusal(why)
    return on


def screen(
    guard: Guardrails | None, cfg: RunConfig, world: World, mine: list[Request], writer: ResultWriter
) -> list[Request]:
    """This rank's queue less the requests whose prompt the text guardrail blocks (recorded as blocked).
    Under --sp the ranks of a group hold one queue: they take its first rank's decisions (one all-gather,
    made whatever was decided), so the group admits the same requests even if a check were not repeatable.
    The checks run before the first pass (about 0.2 s a prompt with the real models: `plan`), every rank then
    waiting for the others within --load-timeout-s."""
    if guard is None:
        return mine
    reasons: dict[str, str | None] = {}  # prompt -> reason: the samples of a line share their prompt
    blocked = {}
    for r in mine:
        if r.prompt not in reasons:
            reasons[r.prompt] = guard.text(r.prompt)
        if reasons[r.prompt] is not None:
            blocked[r.id] = reasons[r.prompt]
    # The ranks' queues differ in length: they meet again with the start-up deadline, not the pass loop's.
    world.wait_for_ranks(cfg.load_timeout_s, "checking their prompts (guardrails)")
    if cfg.sp > 1:
        blocked = world.all_gather_object(blocked)[world.rank - world.rank % cfg.sp]
    if world.rank % cfg.sp == 0:  # the group's first rank writes its requests' records
        for r in mine:
            if r.id in blocked:
                writer.block(r, blocked[r.id], "prompt")
    return [r for r in mine if r.id not in blocked]
