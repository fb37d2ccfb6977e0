"""`plan` on very large request files: wall time and peak memory (docs/scale.md, "A million requests").

    python scripts/bench/plan_scale.py [--quick] [--with-model]

Writes a dataset-like mix (half 1024x1024 images, 480p and 720p videos of 61-189 frames, 35-50 steps, with
and without guidance, prompts repeating every 5,000 lines) and runs `cosmos3-batch plan FILE --nproc N` in a
fresh process per configuration: 100k requests at 64 ranks and 1M at 512 (--quick: 10k at 8 and 100k at 64).
Each row prints the seconds, the process's peak resident memory, and both against the goals (60 s, 2 GB at
1M): a ratio below 1 meets it. --with-model adds `--model` with a config-only Cosmos3-Nano folder (memory,
bytes and the roofline too: templated prompt lengths). The whole run is one process per row, one thread.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GOAL_S, GOAL_BYTES = 60.0, 2e9
CONFIGS = [(100_000, 64), (1_000_000, 512)]
QUICK = [(10_000, 8), (100_000, 64)]


def write_requests(path: Path, count: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(count):
            kind = rng.random()
            if kind < 0.5:
                shape = {"size": "1024x1024", "num_frames": 1}
            elif kind < 0.8:
                shape = {"size": "832x480", "num_frames": rng.choice([61, 93, 121])}
            else:
                shape = {"size": "1280x720", "num_frames": rng.choice([93, 121, 189])}
            row = {"id": f"r{i:07d}", "prompt": f"scene {i % 5000}: a red cube on a table", **shape}
            row |= {"num_inference_steps": rng.randint(35, 50), "guidance_scale": rng.choice([1.0, 4.0, 6.0])}
            f.write(json.dumps(row) + "\n")


def plan_once(prompts: Path, nproc: int, model: Path | None) -> tuple[float, int, dict]:
    """(seconds, peak RSS bytes of the plan process, its JSON document) of one fresh `plan` process."""
    cmd = [sys.executable, "-m", "cosmos3_batch", "plan", str(prompts), "--nproc", str(nproc), "--json"]
    cmd += ["--model", str(model)] if model is not None else []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with tempfile.TemporaryFile() as stdout:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.DEVNULL, env=env)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak, not the largest child's so far
        seconds = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        assert proc.returncode == 0, f"{cmd}: exit {proc.returncode}"
        stdout.seek(0)
        return seconds, usage.ru_maxrss * 1024, json.loads(stdout.read())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="10k at 8 ranks and 100k at 64 (a smoke run).")
    parser.add_argument("--with-model", action="store_true", help="Also plan with a config-only Nano folder.")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from calibrate_plan import nano_folder  # a sibling: the config-only Nano checkpoint

    root = Path(tempfile.mkdtemp(prefix="plan-scale-"))
    try:
        models = [None] + ([nano_folder(root)] if args.with_model else [])
        print(f"{'requests':>9} {'ranks':>5} {'model':>6} {'seconds':>8} {'peak MiB':>9} {'s/goal':>7} "
              f"{'mem/goal':>8} {'passes':>7}")  # fmt: skip
        for count, nproc in QUICK if args.quick else CONFIGS:
            prompts = root / f"p{count}.jsonl"
            write_requests(prompts, count)
            for model in models:
                seconds, peak, doc = plan_once(prompts, nproc, model)
                assert doc["requests"] == count
                name = "nano" if model else "-"
                print(
                    f"{count:>9,} {nproc:>5} {name:>6} {seconds:>8.1f} {peak / 2**20:>9,.0f} "
                    f"{seconds / GOAL_S:>7.2f} {peak / GOAL_BYTES:>8.2f} {doc['simulation']['passes']:>7,}"
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
