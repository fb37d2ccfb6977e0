"""Decoding and writing finished requests off the pass loop.

A VAE decode of a 720p, 189-frame video takes tens of seconds and its MP4 encode seconds more; inside
the lockstep loop every other rank would wait for them at the next pass's all-reduce. Here one worker
thread decodes (on its own CUDA stream, after an event that marks the latents final) and reports every
outcome, failures found by the loop included, so reports are serialized by the thread itself and the
loop never takes a lock that a write holds. The same thread crosses a Transfer chain's chunk boundaries
(`hand_off`: the chunk's decode and the next chunk's encodes), in order with the decodes.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from cosmos3_batch.parallel.waiting import WaitMark
from cosmos3_batch.pipeline.kinds.denoise import RequestJob, Result

Report = Callable[[RequestJob, Result | None, str | None], None]


class Finisher:
    def __init__(self, report: Report, device: torch.device, cuda=None):
        self.report = report
        self.device = device
        self.cuda = cuda if cuda is not None else torch.cuda  # stand-ins in tests/unit/test_finisher.py
        on_gpu = device.type == "cuda"
        self._side = self.cuda.Stream(device) if on_gpu else None
        # A new thread starts on device 0: point it at this rank's GPU.
        init = (lambda: self.cuda.set_device(device)) if on_gpu else None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="finisher", initializer=init)
        self._pending: list[Future] = []
        # Its waits (a decode's read of the device, a VAE group's messages), for rank 0's monitor.
        self.mark = WaitMark("the finisher")
        self.lost: BaseException | None = None  # a decode that met a lost peer: the loop ends the job

    def submit(self, job: RequestJob, write: bool = True) -> None:
        """Decode and write a request whose last step has been issued; `write=False`: decode only (a rank that
        decodes with its --vae-patch-parallel-size group's writer; it reports nothing)."""
        ready = None
        if self._side is not None:
            # The last scheduler step was issued on the compute stream: decode only after it has run.
            ready = self.cuda.Event()
            ready.record(self.cuda.current_stream(self.device))
        self._queue(self._finish, job, ready, write)

    def hand_off(self, work: Callable[[], Any]) -> Future:
        """Run `work` on this thread after what the compute stream has been given so far. The future's result
        is (work's result, an event on the side stream after work's kernels, None off GPU): wait for that
        event on the compute stream before reading what work wrote. Tensors work allocates belong to the side
        stream; when freed there later, their blocks go only to side-stream work, which starts after a
        `ready` event recorded after the compute stream last read them (the chain hands off again only
        after its steps). An exception in work is the future's: the caller decides what it fails."""
        ready = None
        if self._side is not None:
            ready = self.cuda.Event()
            ready.record(self.cuda.current_stream(self.device))
        return self._pool.submit(self._cross, work, ready)

    @torch.no_grad()  # grad mode is per thread
    def _cross(self, work: Callable[[], Any], ready) -> tuple[Any, Any]:
        if ready is None:
            return work(), None
        with self.cuda.stream(self._side):
            self._side.wait_event(ready)
            try:
                out = work()
            except BaseException:
                self._side.synchronize()  # as in `_finish`: no kernel left reading memory the caller frees
                raise
            done = self.cuda.Event()
            done.record(self._side)
        return out, done

    def check(self) -> None:
        """Called by the pass loop every pass: a decode that met a lost peer ends the job (exit 69), as the
        loop's own collectives would a moment later, rather than fail its request alone."""
        if self.lost is not None:
            raise self.lost

    def fail(self, job: RequestJob, error: str) -> None:
        """Record a failure found by the loop, in order with the writes, without waiting for them."""
        self._queue(self.report, job, None, error)

    def done(self, job: RequestJob, result: Result) -> None:
        """Write a request decoded earlier (a captioned one: kinds/chained.py), in order with the others."""
        self._queue(self.report, job, result, None)

    def _queue(self, fn, *args) -> None:
        # Finished futures are dropped, failed ones kept: close() re-raises them (no report is lost).
        self._pending = [f for f in self._pending if not f.done() or f.exception() is not None]
        self._pending.append(self._pool.submit(fn, *args))

    @property
    def backlog(self) -> int:
        return sum(not f.done() for f in self._pending)

    @torch.no_grad()  # grad mode is per thread
    def _finish(self, job: RequestJob, ready, write: bool = True) -> None:
        try:
            # On a GPU the decode's host copies wait for its kernels, and those for what the streams hold.
            with self.mark.waiting("a decode (a host read of the device)"):
                if ready is None:
                    result = job.decode()
                else:
                    with self.cuda.stream(self._side):
                        self._side.wait_event(ready)
                        result = job.decode()  # ends in host copies, which wait for this stream only
        except Exception as exc:
            if self._side is not None:
                # A decode that failed midway may leave kernels queued on the side stream that read the
                # latents. The caching allocator tracks those (allocated on the compute stream) by the
                # compute stream only: once the report drops the job, their memory could be handed out
                # again under the running kernels. Wait for this one stream (error path only; not a
                # device-wide sync) before letting go of them.
                self._side.synchronize()
            if isinstance(exc, dist.DistError):  # a lost peer's, not this request's: the loop ends the job
                self.lost = exc
                return
            if write:  # else the group's writer reports it (a broken group ends the job: vae_team.py)
                self.report(job, None, f"{type(exc).__name__}: {exc}")
            return
        if write:
            self.report(job, result, None)

    def close(self) -> None:
        """Wait until every submitted request is decoded and reported (at the end of the run only)."""
        for future in self._pending:
            future.result()
        self._pending.clear()
        self._pool.shutdown(wait=True)
