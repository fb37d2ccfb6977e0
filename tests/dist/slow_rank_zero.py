"""`cosmos3_batch` with rank 0 late to start (a slow import on a busy node): it sleeps first.

python -m torch.distributed.run --nproc-per-node 2 -m tests.dist.slow_rank_zero SECONDS ARGS...
"""

from __future__ import annotations

import os
import sys
import time

if __name__ == "__main__":
    if os.environ.get("RANK") == "0":
        time.sleep(float(sys.argv[1]))
    from cosmos3_batch.cli import main

    sys.argv = ["cosmos3_batch", *sys.argv[2:]]
    main()
