"""--sp 1 / 2 / 4 (and --vae-patch-parallel-size) side by side: latency of one long request and time per
output on a batch, in one run.

    python scripts/bench/sp.py [--world 4] [--quick] [--keep DIR]

Builds a random checkpoint with 8 attention heads and 2 KV heads (`make-tiny`, float32), then runs two
workloads through the real CLI under torchrun (gloo on CPU, one thread per rank) at every --sp that
divides --world:

* long: one 512x512, 17-frame video (1,280 GEN tokens), CFG on: what --sp is for;
* batch: 8 shorter videos (256x256, 9 frames: 192 GEN tokens each): what data parallelism is for.

The long request runs at every --sp with --vae-patch-parallel-size P = 1 (the group's first rank
decodes) and P = S (the group decodes it together, DESIGN.md §15).

Per row: P, the request latency (metrics.csv latency_s: admission to files written; the long request's, or
the batch's mean), its denoise time (denoise_s: first to last step, the part --sp splits), its VAE decode
time (decode_s, on the writing rank; split over P ranks) and decode peak per rank (the busiest rank's,
measured by running the same walk on meta tensors: plan/decode_memory.py, float32), the pass-loop seconds
(max over ranks of summary.json pass_s: weight waits + layer compute + all-to-alls), the job's wall time
(load and VAE decode included), outputs per minute, the all-to-alls per rank, and whether every output's
latents and files equal --sp 1's bit for bit. Nothing is asserted.
On a CPU box with fewer cores than ranks, ranks share cores: the ratios then say how the work splits, not
what a GPU per rank would give.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
MODELS = {"full": ("8", "512", "2048"), "quick": ("2", "64", "128")}  # layers, hidden, intermediate


def workloads(quick: bool) -> dict[str, list[dict]]:
    long_size, long_frames, steps = ("256x256", 9, 2) if quick else ("512x512", 17, 4)
    long = [{"id": "long", "prompt": "a long shot of a harbour at dusk", "size": long_size,
             "num_frames": long_frames, "num_inference_steps": steps, "guidance_scale": 6.0}]  # fmt: skip
    batch = [
        {"id": f"b{i}", "prompt": f"scene {i}", "size": "128x128" if quick else "256x256", "num_frames": 9,
         "num_inference_steps": 2, "guidance_scale": 4.0 if i % 2 else 1.0}
        for i in range(4 if quick else 8)
    ]  # fmt: skip
    return {"long": long, "batch": batch}


def run_one(
    folder: Path, model: Path, prompts: Path, world: int, sp: int, max_active: int, parts: int = 1
) -> dict:
    out = folder / f"out-sp{sp}-p{parts}-{prompts.stem}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    cmd += ["-m", "cosmos3_batch", "run", str(prompts), "--model", str(model), "--out", str(out)]
    cmd += ["--sp", str(sp), "--max-active", str(max_active), "--save-latents", "--no-progress"]
    cmd += ["--vae-patch-parallel-size", str(parts)]
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=ROOT)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"--sp {sp} {prompts.stem} failed:\n{proc.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    latencies = [float(row["latency_s"]) for row in rows]
    return {
        "out": out,
        "latency_s": sum(latencies) / len(latencies),
        "denoise_s": sum(float(row["denoise_s"]) for row in rows) / len(rows),
        "decode_s": sum(float(row["decode_s"]) for row in rows) / len(rows),
        "pass_s": max(r["pass_s"] for r in summary["ranks"]),
        "wall_s": wall,
        "outputs_per_min": 60 * len(latencies) / wall,
        "all_to_alls": max(r["all_to_alls"] for r in summary["ranks"]),
    }


def same_outputs(a: Path, b: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    files = sorted(p.name for p in a.glob("*.latents.safetensors"))
    media = sorted(p.name for p in a.glob("*.png")) + sorted(p.name for p in a.glob("*.mp4"))
    return (
        bool(files)
        and all(torch.equal(load_file(a / name)["latents"], load_file(b / name)["latents"]) for name in files)
        and all((a / name).read_bytes() == (b / name).read_bytes() for name in media)
    )


def decode_gib(model: Path, row: dict, parts: int) -> float:
    """The busiest rank's decode peak for this request (the walk on meta tensors), float32."""
    import torch

    from cosmos3_batch.plan.decode_memory import decode_peak_bytes

    width, height = (int(v) for v in row["size"].split("x"))
    config = (model / "vae" / "config.json").read_text()
    return decode_peak_bytes(config, width, height, row["num_frames"], torch.float32, False, parts) / 2**30


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world", type=int, default=4, help="ranks (torchrun --nproc-per-node)")
    parser.add_argument("--quick", action="store_true", help="a tiny model and short requests (smoke run)")
    parser.add_argument("--keep", type=Path, help="keep the checkpoint and outputs here")
    args = parser.parse_args()
    folder = args.keep or Path(tempfile.mkdtemp(prefix="bench-sp-"))
    folder.mkdir(parents=True, exist_ok=True)
    layers, hidden, inter = MODELS["quick" if args.quick else "full"]
    model = folder / "model"
    make = [sys.executable, "-m", "cosmos3_batch", "make-tiny", str(model), "--force", "--heads", "8"]
    make += ["--kv-heads", "2", "--layers", layers, "--hidden", hidden, "--intermediate", inter]
    subprocess.run(make, check=True, env=ENV, cwd=ROOT, capture_output=True)
    sps = [s for s in (1, 2, 4) if args.world % s == 0]
    print(f"world {args.world}, model layers={layers} hidden={hidden} intermediate={inter} 8 heads / 2 KV")
    header = f"{'workload':8} {'--sp':>4} {'P':>2} {'latency s':>10} {'denoise s':>9} {'decode s':>8}"
    header += f" {'dec GiB/rk':>10} {'pass s':>8} {'wall s':>8} {'out/min':>8}"
    print(header + f" {'a2a/rank':>9} {'denoise x':>9} {'bit-exact':>9}")
    for name, rows in workloads(args.quick).items():
        prompts = folder / f"{name}.jsonl"
        prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
        base = None
        for sp, parts in [(s, p) for s in sps for p in sorted({1, s} if name == "long" else {1})]:
            # One request: one slot is all it needs. The batch: 2 per DP group.
            m = run_one(folder, model, prompts, args.world, sp, 1 if name == "long" else 2, parts)
            base = base or m
            exact = "yes" if same_outputs(base["out"], m["out"]) else "NO"
            speedup = base["denoise_s"] / m["denoise_s"]
            gib = decode_gib(model, rows[0], parts)
            print(
                f"{name:8} {sp:>4} {parts:>2} {m['latency_s']:>10.2f} {m['denoise_s']:>9.2f} "
                f"{m['decode_s']:>8.2f} {gib:>10.3f} {m['pass_s']:>8.2f} {m['wall_s']:>8.2f} "
                f"{m['outputs_per_min']:>8.2f} {m['all_to_alls']:>9} {speedup:>8.2f}x {exact:>9}"
            )


if __name__ == "__main__":
    main()
