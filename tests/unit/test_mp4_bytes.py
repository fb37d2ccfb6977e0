"""An MP4's bytes are a function of its frames alone: x264 and the RGB -> YUV conversion run on one thread.

x264's default thread count is 1.5 per CPU the encoder may use, and its output depends on it; with several
threads it also depended, in 5 of 3,800 encodes under load here, on their timing (docs/outputs.md
"MP4 bytes"). The second can't be provoked on demand; the first can: the encoder inherits the CPU affinity of
the thread that starts it.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from cosmos3_batch.io.outputs import write_mp4
from tests.conftest import x264_settings


def clip() -> np.ndarray:
    rng = np.random.default_rng(3)
    return rng.integers(0, 256, (6, 64, 96, 3), dtype=np.uint8)


def test_the_encoder_runs_on_one_thread(tmp_path):
    write_mp4(tmp_path / "a.mp4", clip(), 8.0)
    options = x264_settings(tmp_path / "a.mp4").split()
    assert {"threads=1", "lookahead_threads=1", "sliced_threads=0"} <= set(options)


def test_the_bytes_do_not_depend_on_the_cpus_the_encoder_may_use(tmp_path):
    cpus = os.sched_getaffinity(0)
    if len(cpus) < 2:
        pytest.skip("one CPU: the encoder's thread count cannot be made to differ")
    one = {min(cpus)}
    os.sched_setaffinity(0, one)  # this thread's: the encoder's process inherits it
    try:
        assert os.sched_getaffinity(0) == one
        write_mp4(tmp_path / "one.mp4", clip(), 8.0)
    finally:
        os.sched_setaffinity(0, cpus)
    write_mp4(tmp_path / "all.mp4", clip(), 8.0)
    assert (tmp_path / "one.mp4").read_bytes() == (tmp_path / "all.mp4").read_bytes()
