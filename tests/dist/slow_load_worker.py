"""tests/dist/jobs.py with rank 1 slow to load (a cold checkpoint read): `load_context` sleeps first there.

python -m torch.distributed.run --nproc-per-node 2 -m tests.dist.slow_load_worker SECONDS JOBS CODES
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from cosmos3_batch.pipeline.job import load as job
from tests.dist import jobs

if __name__ == "__main__":
    delay, load = float(sys.argv[1]), job.load_context

    def slow_load(*args, **kwargs):
        if os.environ["RANK"] == "1":
            time.sleep(delay)
        return load(*args, **kwargs)

    job.load_context = slow_load
    jobs.main(Path(sys.argv[2]), Path(sys.argv[3]))
