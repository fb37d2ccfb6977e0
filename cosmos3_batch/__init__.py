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
CNR_SET_BY_US = "MKL_CBWR" not in os.environ
os.environ.setdefault("MKL_CBWR", STRICT_CNR)
