"""Decoding and writing finished requests off the pass loop.

A VAE decode of a 720p, 189-frame video takes tens of seconds; inside the lockstep loop every other
rank would wait for it at the next pass's all-reduce. Here one worker thread decodes (on its own CUDA
stream, after an event that marks the latents final) and hands results to the writer, while the
loop goes on fetching layers for the requests still denoising.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from cosmos3_batch.pipeline.denoise import RequestJob, Result

Report = Callable[[RequestJob, Result | None, str | None], None]


class Finisher:
    def __init__(self, report: Report, device: torch.device):
        self.report = report
        self.device = device
        cuda = device.type == "cuda"
        self._side = torch.cuda.Stream(device) if cuda else None
        # A new thread starts on device 0: point it at this rank's GPU.
        init = (lambda: torch.cuda.set_device(device)) if cuda else None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="finisher", initializer=init)
        self._pending: list[Future] = []

    def submit(self, job: RequestJob) -> None:
        ready = None
        if self._side is not None:
            # The last scheduler step was issued on the compute stream: decode only after it has run.
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        self._pending.append(self._pool.submit(self._finish, job, ready))

    @torch.no_grad()  # grad mode is per thread
    def _finish(self, job: RequestJob, ready) -> None:
        try:
            if ready is None:
                result = job.decode()
            else:
                with torch.cuda.stream(self._side):
                    self._side.wait_event(ready)
                    result = job.decode()  # ends in host copies, which wait for this stream only
        except Exception as exc:
            self.report(job, None, f"{type(exc).__name__}: {exc}")
            return
        self.report(job, result, None)

    def drain(self) -> None:
        """Wait until every submitted request is decoded and reported."""
        for future in self._pending:
            future.result()
        self._pending.clear()

    def close(self) -> None:
        self.drain()
        self._pool.shutdown(wait=True)


def locked(lock: threading.Lock, report: Report) -> Report:
    """Reports come from the loop (failures) and the finisher (results): one at a time."""

    def call(job: RequestJob, result: Result | None, error: str | None) -> None:
        with lock:
            report(job, result, error)

    return call
