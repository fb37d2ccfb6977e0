"""Engine benchmark on this machine's CPU: offload modes side by side in one run.

    python scripts/bench/engine.py [--quick] [--csv bench_engine.csv]

Builds a mid-size random checkpoint (make-tiny, float32), runs the same JSONL through `resident`,
`local`, `allgather` and `sharded` at world sizes 1 and 2 (real torchrun, gloo), and prints per mode:
seconds per pass and its ratio to `resident` at the same world size, the stall fraction (time compute
waited for weights / pass time), weight bytes moved per pass per rank, and host memory per rank
(RssAnon and Pss deltas from /proc, via scripts/tools/mem_probe.py) for allgather vs local vs a naive full
load. Timings are measured side by side in one run; nothing here is asserted.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
MODES = ("resident", "local", "allgather", "sharded")


def make_model(folder: Path, quick: bool) -> Path:
    layers, hidden, inter = (8, 128, 512) if quick else (24, 384, 1536)
    path = folder / "model"
    cmd = [sys.executable, "-m", "cosmos3_batch", "make-tiny", str(path), "--layers", str(layers)]
    cmd += ["--hidden", str(hidden), "--heads", "4", "--kv-heads", "2", "--intermediate", str(inter)]
    subprocess.run(cmd, check=True, env=ENV, capture_output=True)
    return path


def workload(folder: Path, quick: bool) -> Path:
    steps = 2 if quick else 6
    rows = [
        {
            "id": f"b{i}",
            "prompt": f"benchmark prompt {i}",
            "num_frames": 5,
            "size": "64x64",
            "num_inference_steps": steps,
        }
        for i in range(4)
    ]
    path = folder / "bench.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_job(model: Path, prompts: Path, out: Path, mode: str, world: int) -> dict:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    cmd = [*launcher, "-m", "cosmos3_batch", "run", str(prompts), "--model", str(model), "--out", str(out)]
    cmd += ["--offload", mode, "--max-active", "4", "--no-progress", "--overwrite"]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} x{world} failed:\n{proc.stderr[-2000:]}")
    return json.loads((out / "summary.json").read_text())


def probe_memory(model: Path, folder: Path, mode: str) -> list[dict]:
    out = folder / f"mem-{mode}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += [str(ROOT / "scripts" / "tools" / "mem_probe.py"), str(model), mode, str(out)]
    subprocess.run(cmd, env=ENV, check=True, capture_output=True)
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(2)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small model and workload (CI smoke run)")
    parser.add_argument("--csv", type=Path, help="also write the table as CSV")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        folder = Path(tmp)
        model, prompts = make_model(folder, args.quick), workload(folder, args.quick)
        layer_mb = sum(f.stat().st_size for f in (model / "transformer").glob("*.safetensors")) / 2**20
        print(
            f"model: {layer_mb:.0f} MB of transformer weights (float32); workload: 4 requests, max-active 4"
        )
        rows = []
        for world in (1, 2):
            base = None
            for mode in MODES:
                summary = run_job(model, prompts, folder / f"out-{mode}-{world}", mode, world)
                rank0 = summary["ranks"][0]
                per_pass = rank0["pass_s"] / max(rank0["passes"], 1)
                base = per_pass if mode == "resident" else base
                rows.append(
                    {
                        "world": world,
                        "mode": mode,
                        "s_per_pass": round(per_pass, 4),
                        "ratio_to_resident": round(per_pass / base, 3),
                        "stall_fraction": round(rank0["stall_s"] / max(rank0["pass_s"], 1e-9), 3),
                        "MB_moved_per_pass": round(
                            (rank0["h2d_bytes"] + rank0["gathered_bytes"]) / max(rank0["passes"], 1) / 2**20,
                            2,
                        ),
                        "job_wall_s": summary["wall_s"],
                    }
                )
        print_table(rows)
        memory = []
        for mode in ("allgather", "local", "naive"):
            rank0 = probe_memory(model, folder, mode)[0]
            memory.append(
                {
                    "mode": mode,
                    "rss_anon_MB": round(rank0["rss_anon_delta"] / 2**20, 1),
                    "pss_MB": round(rank0["pss_delta"] / 2**20, 1),
                    "share_of_layers": round(rank0["rss_anon_delta"] / rank0["layer_bytes"], 3),
                }
            )
        print("\nhost memory per rank for layer weights (N=2, from /proc):")
        print_table(memory)
        if args.csv:
            with open(args.csv, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=list(rows[0]))
                writer.writeheader()
                writer.writerows(rows)


def print_table(rows: list[dict]) -> None:
    keys = list(rows[0])
    widths = {k: max(len(k), *(len(str(r[k])) for r in rows)) for k in keys}
    print("  ".join(k.rjust(widths[k]) for k in keys))
    for row in rows:
        print("  ".join(str(row[k]).rjust(widths[k]) for k in keys))


if __name__ == "__main__":
    main()
