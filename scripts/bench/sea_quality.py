"""What `--cache sea` costs in accuracy on the trained demo model, against no cache, at three thresholds.

    python scripts/bench/sea_quality.py [--thresholds 0.1,0.25,0.5] [--nproc 2]

Every held-out prompt of the demo grammar (62 pictures, 52 clips; combinations the model never saw), at the
demo's settings (30 steps, guidance 4.0, seed 100 + i), exactly as tests/dist/test_demo_model.py runs them:
one `cosmos3-torchrun --nproc-per-node 2 ... --offload allgather` per setting, the outputs read back as
written (PNG, MP4) and judged by the demo's pixel judge (cosmos3_batch/model/demo/judge.py) alone.

Printed, one row per setting (no cache first, then `--cache sea --cache-threshold T`, the other
SeaCacheConfig fields at diffusers' defaults):
- pictures right: colour, background and position all as asked (of 62);
- clips right: the figure moves the asked way (of 52);
- same verdict as no cache: outputs judged exactly as the uncached output of the same request was;
- forwards reused: summary.json's cache.reused_share (branch forwards that reused a residual instead of
  running the decoder stack); passes skipped: its skipped_share (passes that fetched no layer at all);
- wall s: the job's wall clock (2 CPU ranks; a ratio between rows, not a GPU figure).

How to read it: accuracy that stays at the uncached row's while the reused share grows is what the cache
buys for free; the threshold where pictures or clips start to drop is where to stop raising it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import imageio.v3 as iio
import numpy as np

from cosmos3_batch.model.demo import grammar
from cosmos3_batch.model.demo.judge import Verdict, judge
from cosmos3_batch.model.demo.trained import write_trained


def frames_of(out: Path, scene: grammar.Scene) -> np.ndarray:
    if scene.is_video:
        return np.stack(list(iio.imiter(out / f"{scene.id}.mp4")))
    return iio.imread(out / f"{scene.id}.png")[None]


def run_setting(model: Path, prompts: Path, out: Path, nproc: int, flags: list[str]) -> dict:
    cmd = [sys.executable, "-m", "cosmos3_batch.parallel.launch", "--nproc-per-node", str(nproc)]
    cmd += ["-m", "cosmos3_batch", "run", str(prompts), "--model", str(model), "--out", str(out)]
    done = subprocess.run(
        [*cmd, "--offload", "allgather", "--no-progress", *flags], capture_output=True, text=True
    )
    if done.returncode != 0:
        sys.exit(f"{' '.join(flags) or 'no cache'}: exit {done.returncode}\n{done.stderr[-4000:]}")
    return json.loads((out / "summary.json").read_text())


def right(scene: grammar.Scene, verdict: Verdict) -> bool:
    """The demo test's bar: a picture shows all three asked properties; a clip moves the asked way."""
    return verdict.place if scene.is_video else verdict.all


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--thresholds", default="0.1,0.25,0.5", help="--cache-threshold values, comma-separated"
    )
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    settings = [("no cache", [])] + [
        (f"sea {t}", ["--cache", "sea", "--cache-threshold", t]) for t in args.thresholds.split(",")
    ]
    scenes = grammar.split_scenes(video=False)[1] + grammar.split_scenes(video=True)[1]
    images = sum(not s.is_video for s in scenes)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = write_trained(root / "model")
        prompts = root / "held_out.jsonl"
        rows = [grammar.request(s, seed=100 + i) for i, s in enumerate(scenes)]
        prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{images} held-out pictures, {len(scenes) - images} clips, 30 steps, world {args.nproc}")
        print("| setting | pictures right | clips right | same verdict as no cache | forwards reused "
              "| passes skipped | wall s |")  # fmt: skip
        print("| --- | --- | --- | --- | --- | --- | --- |")
        uncached: dict[str, Verdict] = {}
        for name, flags in settings:
            summary = run_setting(model, prompts, root / name.replace(" ", "-"), args.nproc, flags)
            verdicts = {s.id: judge(s, frames_of(root / name.replace(" ", "-"), s)) for s in scenes}
            uncached = uncached or verdicts
            pictures = sum(right(s, verdicts[s.id]) for s in scenes if not s.is_video)
            clips = sum(right(s, verdicts[s.id]) for s in scenes if s.is_video)
            same = sum(verdicts[s.id] == uncached[s.id] for s in scenes)
            cache = summary.get("cache") or {}
            print(
                f"| {name} | {pictures}/{images} | {clips}/{len(scenes) - images} | {same}/{len(scenes)} "
                f"| {cache.get('reused_share', 0.0):.1%} | {cache.get('skipped_share', 0.0):.1%} "
                f"| {summary['wall_s']:.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
