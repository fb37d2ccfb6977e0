"""Distilled (4-step) against base checkpoints, side by side: what `plan` predicts for Super on H200s, and
what the CPU yardstick measures on the tiny models.

    python scripts/bench/checkpoint_kinds.py [--requests 10000] [--gpus 8] [--yardstick N] [--repeats 2]

1. plan: config-only folders of Super (plan/shapes.py SUPER_TRANSFORMER, the Wan2.2 VAE) as a base
   checkpoint and as a 4-step distilled one; N T2I requests of 1024x1024, the base at its defaults (50 steps,
   guidance 6.0: two branches) and the distilled at its fixed schedule (4 steps, one branch). Printed: job
   hours, outputs per hour, weight bytes moved per output and their ratios. Nothing runs.
2. yardstick (`--yardstick N`, default 8): `cosmos3-torchrun --nproc-per-node 2` on the tiny base and the
   tiny distilled checkpoint (same transformer shape), N 64x64 T2I requests each at --max-active 4, the two
   alternated `--repeats` times; printed: forwards per output (GEN half applications / layers / outputs, from
   summary.json), seconds per output (wall, best of the repeats) and the pass loop's seconds per output.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from cosmos3_batch.model.tiny import TinySpec, ensure_default_tiny, write_tiny
from cosmos3_batch.plan.hardware import preset
from cosmos3_batch.plan.job_plan import plan_job
from cosmos3_batch.plan.shapes import SUPER_TRANSFORMER, WAN22_VAE

T2I = {"prompt": "a robot arm on a table", "size": "1024x1024", "num_frames": 1}


def config_folder(source: Path, target: Path) -> Path:
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.safetensors"))
    (target / "transformer" / "config.json").write_text(json.dumps(SUPER_TRANSFORMER))
    (target / "vae" / "config.json").write_text(json.dumps(WAN22_VAE))
    return target


def write_prompts(path: Path, count: int, row: dict) -> Path:
    path.write_text("".join(json.dumps({**row, "id": f"r{i:05d}"}) + "\n" for i in range(count)))
    return path


def plan_rows(root: Path, requests: int, gpus: int) -> None:
    base = config_folder(ensure_default_tiny(), root / "super")
    distilled = config_folder(write_tiny(root / "tiny-4step", TinySpec(distilled=True)), root / "super-4step")
    prompts = write_prompts(root / "t2i.jsonl", requests, T2I)
    print(f"plan: {requests} T2I 1024x1024 requests, {gpus} x H200, allgather, --max-active 4")
    print("| checkpoint | steps x branches | job hours | outputs/hour | weight GB moved/output |")
    print("| --- | --- | --- | --- | --- |")
    figures = {}
    for name, model, work in (("Super (base)", base, "50 x 2"), ("Super-4Step", distilled, "4 x 1")):
        doc, _ = plan_job(str(prompts), str(model), gpus, 1, "allgather", 4, preset("h200"))
        est = doc["estimate"]
        steps = 50 if model is base else 4
        moved = (est["bytes_h2d_per_pass"] + est["bytes_gathered_per_pass"]) * gpus * steps / (4 * gpus)
        figures[name] = (est["job_hours"], est["outputs_per_hour"], moved)
        print(
            f"| {name} | {work} | {est['job_hours']:.2f} | {est['outputs_per_hour']:,.0f} "
            f"| {moved / 1e9:.2f} |"
        )
    (bh, bo, bm), (dh, do, dm) = figures.values()
    print(
        f"distilled / base: job hours {dh / bh:.3f}, outputs/hour {do / bo:.1f}x, bytes/output {dm / bm:.3f}"
    )


def yardstick(root: Path, count: int, repeats: int) -> None:
    models = {
        "base": ensure_default_tiny(),
        "distilled": write_tiny(root / "y-4step", TinySpec(distilled=True)),
    }
    prompts = write_prompts(root / "y.jsonl", count, {**T2I, "size": "64x64"})
    best: dict[str, tuple[float, float, float]] = {}
    for attempt in range(repeats):
        for name, model in models.items():
            out = root / f"y-{name}-{attempt}"
            cmd = [sys.executable, "-m", "cosmos3_batch.parallel.launch", "--nproc-per-node", "2"]
            cmd += ["-m", "cosmos3_batch", "run", str(prompts), "--model", str(model), "--out", str(out)]
            subprocess.run([*cmd, "--max-active", "4", "--no-progress"], check=True, capture_output=True)
            summary = json.loads((out / "summary.json").read_text())
            layers = json.loads((model / "transformer" / "config.json").read_text())["num_hidden_layers"]
            forwards = sum(r["gen_runs"] for r in summary["ranks"]) / layers / count
            pass_s = max(r["pass_s"] for r in summary["ranks"]) / count
            wall = summary["wall_s"] / count
            if name not in best or wall < best[name][1]:
                best[name] = (forwards, wall, pass_s)
    print(f"\nyardstick: {count} T2I 64x64 requests, world 2, --max-active 4, best of {repeats}")
    print("| checkpoint | forwards/output | s/output (wall) | s/output (pass loop) |")
    print("| --- | --- | --- | --- |")
    for name, (forwards, wall, pass_s) in best.items():
        print(f"| tiny {name} | {forwards:.0f} | {wall:.3f} | {pass_s:.3f} |")
    (bf, bw, bp), (df, dw, dp) = best["base"], best["distilled"]
    print(f"distilled / base: forwards {df / bf:.3f}, wall {dw / bw:.3f}, pass loop {dp / bp:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--yardstick", type=int, default=8, help="tiny requests per run (0: skip)")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        plan_rows(Path(tmp), args.requests, args.gpus)
        if args.yardstick:
            yardstick(Path(tmp), args.yardstick, args.repeats)


if __name__ == "__main__":
    main()
