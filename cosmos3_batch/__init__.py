"""Batch image/video generation with Cosmos3 through a distributed layerwise offload engine.

Importing the package sets the CPU numerics policy (docs/numerics.md): MKL's strict Conditional
Numerical Reproducibility, unless the user chose an MKL_CBWR of their own. It must be in the environment
before MKL's first call (MKL reads it once, then), and before torchrun's workers start (they inherit it),
which is why it lives here and not in the CLI.
"""

import os

__version__ = "0.1.0"

# With strict CNR a GEMM row's bits do not depend on the thread count, and from a few rows on not on how
# many rows share the call: what makes --sp shards and batched branches exact on any x86-64 CPU.
STRICT_CNR = "AUTO,STRICT"
# Inherited with MKL_CBWR by the processes we start (cosmos3-torchrun's workers), so they report it as ours.
CNR_MARK = "COSMOS3_BATCH_SET_MKL_CBWR"
CNR_SET_BY_US = "MKL_CBWR" not in os.environ or os.environ.get(CNR_MARK) == os.environ["MKL_CBWR"]
if "MKL_CBWR" not in os.environ:
    os.environ["MKL_CBWR"] = os.environ[CNR_MARK] = STRICT_CNR
