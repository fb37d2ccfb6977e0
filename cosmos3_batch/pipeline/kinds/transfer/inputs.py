"""A Transfer request's host-only inputs, prepared ahead of its admission on a thread of their own.

Reading its control videos (or deriving `"edge"`/`"blur": "auto"` from its video, per frame), preprocessing
and padding each (1-2 GB of host memory per 720p control) and the seed video's preprocessing take seconds on
the host. At admission, on the pass loop's thread, every other rank would wait for them at the next exchange.
So the runner hands the next Transfer requests of its queue to `AheadOfAdmission` each pass; admission takes
the prepared inputs (waiting only if they are not ready yet). Everything here reads files and host tensors
only: no device, no collective, no generator (the noise is drawn at admission, in the reference's order).
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from cosmos3_batch.pipeline.kinds.transfer import chunks
from cosmos3_batch.pipeline.kinds.transfer.controls import derive
from cosmos3_batch.requests.transfer import AUTO

AHEAD = 2  # Transfer requests prepared ahead of admission per rank: each holds its controls in host memory


@dataclass
class HostInputs:
    controls: list[torch.Tensor]  # each control preprocessed at the request's size, padded, in `dtype`
    video: list | None  # the seed video's frames (PIL), as decoded
    seed: torch.Tensor | None  # those frames preprocessed: the first chunk's target seed (None: none)


def read_controls(spec, size: tuple[int, int]) -> tuple[list, list | None]:
    """(each control's frames, read or derived, the seed video's frames or None)."""
    from diffusers.utils import load_video

    video = load_video(spec.video) if spec.video is not None else None
    controls = [
        derive(hint, video, size) if path == AUTO else chunks.load_control(path)
        for hint, path in spec.controls
    ]
    return controls, video


def host_inputs(helper, request, dtype: torch.dtype) -> HostInputs:
    """Everything a Transfer request's admission needs from its files, on the host."""
    spec, size = request.transfer, (request.height, request.width)
    frames, video = read_controls(spec, size)
    length = max(request.num_frames, spec.chunk_frames)
    controls = chunks.prepare_controls(helper, frames, size, dtype, length)
    seed = None
    if video is not None and spec.first_chunk_conditional_frames > 0:
        seed = helper.video_processor.preprocess_video(video, height=size[0], width=size[1])
    return HostInputs(controls, video, seed)


class AheadOfAdmission:
    """The next `AHEAD` Transfer requests of a rank's queue, prepared in queue order on one worker thread."""

    def __init__(self, helper, dtype: torch.dtype, ahead: int = AHEAD) -> None:
        self.helper, self.dtype, self.ahead = helper, dtype, ahead
        self._pool: ThreadPoolExecutor | None = None
        self._futures: dict[str, Future] = {}

    def look(self, queue: Iterable) -> None:
        """Called each pass with the requests not admitted yet, in their order: start the next ones."""
        if len(self._futures) >= self.ahead:
            return
        for request in queue:
            if request.transfer is None or request.id in self._futures:
                continue
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="transfer-inputs")
            self._futures[request.id] = self._pool.submit(host_inputs, self.helper, request, self.dtype)
            if len(self._futures) >= self.ahead:
                return

    def take(self, request) -> Future | None:
        """The request's prepared inputs (a future: admission waits on it), None if none was started."""
        return self._futures.pop(request.id, None)

    def close(self) -> None:
        for future in self._futures.values():
            future.cancel()
        self._futures.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
