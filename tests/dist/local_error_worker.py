"""`cosmos3_batch run` with rank 1 failing while it loads, with an error of its own whose text speaks of a
timeout and a closed connection (a read of a network filesystem, say): a crash, not a peer's stall.

python -m cosmos3_batch.parallel.launch --standalone --nproc-per-node 2 \
    -m tests.dist.local_error_worker ARGS...
"""

from __future__ import annotations

import os
import sys

from cosmos3_batch.pipeline.job import run as job

if __name__ == "__main__":
    load = job.load_model

    def failing_load(*args, **kwargs):
        if os.environ["RANK"] == "1":
            raise RuntimeError("reading /ckpt/transformer timed out: Connection closed by peer (our own)")
        return load(*args, **kwargs)

    job.load_model = failing_load
    from cosmos3_batch.cli import main

    sys.argv = ["cosmos3_batch", *sys.argv[1:]]
    main()
