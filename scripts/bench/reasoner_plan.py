"""plan's reasoner decode figures for Cosmos3-Nano on one node of 8 H200 (issue 44's "both ways"): the UND
half streamed (--offload allgather) against held on the device (--und-resident), for 1, 8 and 64 sequences
per rank (K/V reads left out: at long contexts they add to the HBM time of both ways).
The arithmetic is plan's own (plan/reason_plan.py `decode_rates` on plan/planner.py's UND half of Nano's
published config): a roofline, not a measurement; no GPU is needed.

    python scripts/bench/reasoner_plan.py [--gpu h200] [--nproc 8]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from cosmos3_batch.checkpoint.folder import Checkpoint  # noqa: E402
from cosmos3_batch.engine.transport import OffloadMode  # noqa: E402
from cosmos3_batch.plan.hardware import preset  # noqa: E402
from cosmos3_batch.plan.model_shape import model_shape  # noqa: E402
from cosmos3_batch.plan.planner import und_half_bytes  # noqa: E402
from cosmos3_batch.plan.reason_plan import decode_rates  # noqa: E402
from scripts.bench.calibrate_plan import nano_folder  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default="h200")
    parser.add_argument("--nproc", type=int, default=8)
    args = parser.parse_args()
    import torch

    with tempfile.TemporaryDirectory() as folder:
        nano = nano_folder(Path(folder))
        und = und_half_bytes(model_shape(Checkpoint.open(nano), args.nproc, torch.bfloat16))
        shutil.rmtree(nano)
    hw = preset(args.gpu)
    print(f"Nano's UND half: {und / 2**30:.2f} GiB; {args.nproc} x {args.gpu}, --offload allgather")
    print("sequences/rank  pass ms streamed  tokens/s streamed  pass ms resident  tokens/s resident")
    rows = []
    for per_rank in (1, 8, 64):
        work = {"tokens_per_decode_pass": float(per_rank * args.nproc)}
        rates = decode_rates(und, OffloadMode.ALLGATHER, (args.nproc, 1), hw, work)
        rows.append({"sequences_per_rank": per_rank, **rates})
        cells = [f"{per_rank:>14}"]
        for way in ("streamed", "und_resident"):
            cells.append(f"{rates['pass_s_' + way] * 1e3:>16.2f}  {rates['tokens_per_s_' + way]:>17,.0f}")
        print("  ".join(cells))
    print(json.dumps({"und_bytes": und, "rows": rows}))


if __name__ == "__main__":
    main()
