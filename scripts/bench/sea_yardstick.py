"""The CPU yardstick with and without `--cache sea`, side by side in one run.

    python scripts/bench/sea_yardstick.py [--requests 8] [--repeats 2] [--model DIR] [--threshold T]

`cosmos3-torchrun --nproc-per-node 2` (cosmos3_batch.parallel.launch) on the tiny model (or --model: e.g.
the trained demo model, `make-tiny DIR --trained`), N 64x64 T2I requests of distinct prompts and seeds at
the model's default steps and guidance, --max-active 4, without a cache and with `--cache sea`
(diffusers' defaults but --threshold), the two alternated `--repeats` times. Printed per setting, from
summary.json:
- forwards/output: branch forwards that ran the decoder stack per output (GEN half applications / layers /
  outputs, summed over the ranks);
- reused: summary.json's cache.reused_share; skipped: its skipped_share (passes that fetched nothing);
- s/output (wall): the job's wall clock / outputs, best of the repeats; s/output (pass loop): the slowest
  rank's time walking the layers / outputs.
On 2 CPU ranks a pass is compute-bound, so the pass loop's ratio follows the forwards' ratio; on a GPU with
offload a pass that computes anything still fetches every layer (docs/running.md, Step caching).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from cosmos3_batch.model.tiny import ensure_default_tiny

PROMPTS = ["a red cube", "a blue ball", "a green cone", "a cat on a mat", "waves at dusk", "a tall tower"]


def write_prompts(path: Path, count: int) -> Path:
    rows = [
        {"id": f"r{i:03d}", "prompt": PROMPTS[i % len(PROMPTS)], "size": "64x64", "num_frames": 1, "seed": i}
        for i in range(count)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def one_run(model: Path, prompts: Path, out: Path, flags: list[str], count: int) -> tuple[float, ...]:
    cmd = [sys.executable, "-m", "cosmos3_batch.parallel.launch", "--nproc-per-node", "2"]
    cmd += ["-m", "cosmos3_batch", "run", str(prompts), "--model", str(model), "--out", str(out)]
    subprocess.run([*cmd, "--max-active", "4", "--no-progress", *flags], check=True, capture_output=True)
    summary = json.loads((out / "summary.json").read_text())
    layers = json.loads((model / "transformer" / "config.json").read_text())["num_hidden_layers"]
    forwards = sum(r["gen_runs"] for r in summary["ranks"]) / layers / count
    pass_s = max(r["pass_s"] for r in summary["ranks"]) / count
    cache = summary.get("cache") or {}
    return (
        forwards,
        summary["wall_s"] / count,
        pass_s,
        cache.get("reused_share", 0.0),
        cache.get("skipped_share", 0.0),
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--model", type=Path, default=None, help="default: the built-in tiny model")
    parser.add_argument("--threshold", default="0.25", help="--cache-threshold (diffusers' default 0.25)")
    args = parser.parse_args()
    model = args.model or ensure_default_tiny()
    settings = {"no cache": [], f"--cache sea {args.threshold}": ["--cache", "sea", "--cache-threshold",
                                                                   args.threshold]}  # fmt: skip
    best: dict[str, tuple[float, ...]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        prompts = write_prompts(Path(tmp) / "y.jsonl", args.requests)
        for attempt in range(args.repeats):
            for index, (name, flags) in enumerate(settings.items()):
                row = one_run(model, prompts, Path(tmp) / f"{index}-{attempt}", flags, args.requests)
                if name not in best or row[1] < best[name][1]:
                    best[name] = row
    print(f"yardstick: {args.requests} T2I 64x64 requests, {model.name}, world 2, --max-active 4, "
          f"best of {args.repeats}")  # fmt: skip
    print("| setting | forwards/output | reused | skipped passes | s/output (wall) | s/output (pass loop) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, (forwards, wall, pass_s, reused, skipped) in best.items():
        print(f"| {name} | {forwards:.1f} | {reused:.1%} | {skipped:.1%} | {wall:.3f} | {pass_s:.3f} |")
    (pf, pw, pp, *_), (cf, cw, cp, *_) = best.values()
    print(f"cache / no cache: forwards {cf / pf:.3f}, wall {cw / pw:.3f}, pass loop {cp / pp:.3f}")


if __name__ == "__main__":
    main()
