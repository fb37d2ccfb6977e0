"""Transfer chains on the pass loop, side by side in one run: bytes per output and the chunk gap.

    python scripts/bench/transfer_chain.py [--chains 4] [--videos 4] [--model DIR] [--size 64x64]

`cosmos3-torchrun --nproc-per-node 2` (cosmos3_batch.parallel.launch) on the tiny model (or --model), a job of
N Transfer chains (one edge control of a moving square written here, 17 frames in chunks of 9 overlapping by
1: two chunks, text and control guidance on: 3 forwards a step) and M T2V requests, run as:
- K=1: --max-active 1 (one request per rank per pass), --chunk-gap-passes 2;
- K=4, gap 0: --max-active 4, a chunk boundary waited for at once on the loop;
- K=4, gap 2: --max-active 4, the default: the boundary crossed on the finisher thread while the chain sits
  out two passes and the other requests compute.
Printed per setting, from summary.json and the sidecars: passes, weight bytes moved per output (every rank's
host->device + gathered bytes / outputs: K=4 against K=1 is what sharing a gathered layer between requests
saves), `plan`'s passes and bytes (equal: the simulator replays the gap), the wall seconds per output, and the
loop's summed waits at chunk boundaries (sidecars' boundary_wait_s). On 2 CPU ranks the VAE and the passes
share the same two cores, so the gap's wall-time gain here understates a GPU's (where the decode runs on its
own stream beside the passes).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import imageio
import numpy as np

from cosmos3_batch.model.tiny import ensure_default_tiny

SETTINGS = {
    "K=1": ["--max-active", "1", "--chunk-gap-passes", "2"],
    "K=4, gap 0": ["--max-active", "4", "--chunk-gap-passes", "0"],
    "K=4, gap 2": ["--max-active", "4", "--chunk-gap-passes", "2"],
}


def write_job(folder: Path, chains: int, videos: int, size: str) -> Path:
    width, height = (int(v) for v in size.split("x"))
    frames = [np.zeros((height, width, 3), np.uint8) for _ in range(17)]
    for i, frame in enumerate(frames):  # a bright square moving right
        frame[height // 4 : height // 2, 2 * i : 2 * i + width // 4] = 255
    imageio.mimwrite(folder / "edges.mp4", frames, fps=8)
    rows = [
        {"id": f"chain{i}", "prompt": f"a street, take {i}", "control": {"edge": "edges.mp4"}, "size": size,
         "num_frames": 17, "frames_per_chunk": 9, "guidance_scale": 3.0, "control_guidance": 1.5, "seed": i}
        for i in range(chains)
    ] + [
        {"id": f"t2v{i}", "prompt": f"a cat, take {i}", "size": size, "num_frames": 9, "seed": 100 + i}
        for i in range(videos)
    ]  # fmt: skip
    path = folder / "job.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def one_run(model: Path, prompts: Path, out: Path, flags: list[str]) -> dict:
    cmd = [sys.executable, "-m", "cosmos3_batch.parallel.launch", "--nproc-per-node", "2"]
    cmd += ["-m", "cosmos3_batch", "run", str(prompts), "--model", str(model), "--out", str(out)]
    subprocess.run([*cmd, "--no-progress", *flags], check=True, capture_output=True)
    summary = json.loads((out / "summary.json").read_text())
    ranks = summary["ranks"]
    outputs = sum(r["ok"] for r in ranks)
    waits = sum(
        json.loads(path.read_text())["timings"].get("boundary_wait_s", 0.0)
        for path in out.glob("chain*.json")
    )
    plan = [
        sys.executable,
        "-m",
        "cosmos3_batch",
        "plan",
        str(prompts),
        "--model",
        str(model),
        "--nproc",
        "2",
    ]
    planned = json.loads(subprocess.run([*plan, *flags, "--json"], check=True, capture_output=True).stdout)
    return {
        "passes": ranks[0]["passes"],
        "bytes_per_output": sum(r["h2d_bytes"] + r["gathered_bytes"] for r in ranks) / outputs,
        "plan_passes": planned["simulation"]["passes"],
        "plan_bytes_per_output": planned["simulation"]["bytes_per_output"],
        "wall_s_per_output": summary["wall_s"] / outputs,
        "boundary_wait_s": waits,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chains", type=int, default=4)
    parser.add_argument("--videos", type=int, default=4)
    parser.add_argument("--size", default="64x64")
    parser.add_argument("--model", type=Path, default=None)
    args = parser.parse_args()
    model = args.model if args.model is not None else ensure_default_tiny()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        prompts = write_job(folder, args.chains, args.videos, args.size)
        rows = {
            name: one_run(model, prompts, folder / f"out{i}", flags)
            for i, (name, flags) in enumerate(SETTINGS.items())
        }
    base = rows["K=1"]["bytes_per_output"]
    print(
        f"{args.chains} Transfer chains (2 chunks, 3 forwards a step) + {args.videos} T2V, world 2, {model}"
    )
    head = (
        f"{'setting':<12} {'passes':>6} {'plan':>5} {'bytes/output':>13} {'vs K=1':>7} {'plan bytes/out':>15}"
    )
    print(f"{head} {'s/output':>9} {'boundary wait s':>16}")
    for name, r in rows.items():
        print(
            f"{name:<12} {r['passes']:>6} {r['plan_passes']:>5} {r['bytes_per_output']:>13,.0f} "
            f"{r['bytes_per_output'] / base:>6.2f}x {r['plan_bytes_per_output']:>15,.0f} "
            f"{r['wall_s_per_output']:>9.3f} {r['boundary_wait_s']:>16.3f}"
        )


if __name__ == "__main__":
    main()
