"""Running this rank's queue, and closing what the run opened whatever happens: the metrics part file, the
open shards, the engine, the pass timeline; and the progress bar both the loop and the finisher update."""

from __future__ import annotations

import logging
import threading

from tqdm import tqdm

from cosmos3_batch.config import RunConfig
from cosmos3_batch.io.metrics import PassRecord, write_passes
from cosmos3_batch.io.space import disk_errno
from cosmos3_batch.parallel.stall import peer_failure
from cosmos3_batch.parallel.stop import StopRequest
from cosmos3_batch.parallel.vae_group import GroupBroken
from cosmos3_batch.parallel.world import World
from cosmos3_batch.pipeline.finish.results import ResultWriter
from cosmos3_batch.pipeline.passes.runner import PassRunner
from cosmos3_batch.requests.parse import Request

log = logging.getLogger("cosmos3_batch")


def drive(
    cfg: RunConfig,
    world: World,
    runner: PassRunner,
    mine: list[Request],
    writer: ResultWriter,
    bar: Progress,
    stop: StopRequest,
) -> None:
    """Run this rank's queue; whatever happens, close the metrics part file and the engine and keep the
    pass timeline (a full disk may refuse it: it is for the report only)."""
    try:
        runner.run(mine)
        for job in runner.abandoned:  # stopped mid-denoise: on record, and redone by the next run
            writer.row(job, "interrupted", error=f"stopped by {_cause(stop)} mid-denoise")
    except GroupBroken as exc:  # a RuntimeError too, but it says what failed on this rank
        if peer_failure(exc) is None:  # a peer's stall or death is said once, by `_peer_lost`
            log.error("the job ends: %s", exc)
        raise
    except BaseException:
        bar.close()
        raise
    finally:
        try:
            writer.finish()  # the open shards finalized (their rows follow), or lost to a full disk
        finally:
            writer.metrics.close()
        runner.weights.close()
        try:
            write_passes(cfg.out, world.rank, cfg.tag, PassRecord._fields, runner.timeline)
        except OSError as exc:
            if disk_errno(exc) is None:
                raise


def _cause(stop: StopRequest) -> str:
    if stop.fault is not None:
        return "a full disk" if stop.fault.kind == "disk" else "a changed checkpoint"
    return stop.name or "a peer rank"


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
