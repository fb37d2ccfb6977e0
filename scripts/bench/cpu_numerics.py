"""What the CPU numerics policy costs: MKL strict CNR (the default) against MKL's own default, side by side.

    python scripts/bench/cpu_numerics.py [--quick] [--repeats 2] [--keep DIR]

Strict CNR (`MKL_CBWR=AUTO,STRICT`, set by `import cosmos3_batch` unless MKL_CBWR is set) fixes each GEMM
row's reduction order so that neither the thread count nor the rows sharing a call change its bits; it
may pick slower kernels. This measures what that costs, alternating the two settings in one run:

* gemm: float32 F.linear, 1024 x 512 -> 2048 (a hidden-512 MLP projection), at 1 and 2 threads: ms/call;
* run: the real CLI on a random hidden-512, 8-layer checkpoint (`make-tiny`), 8 videos of 256x256 x 9
  frames, 2 steps, single process (2 threads) and under torchrun at world 2 with `--sp 2` (1 thread/rank).
  Per row: the pass loop (summary.json pass_s: layer compute + weight waits, max over ranks) and the wall
  time, each the best of --repeats, and whether the latents equal the other setting's bit for bit.

"MKL default" is `MKL_CBWR=` (empty: MKL's own default, CNR off). The last column is strict / default:
above 1.00 strict is slower. Nothing is asserted; read the ratios, not the absolute seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from cosmos3_batch.model.numerics import cpu_name

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = {"MKL default": "", "strict CNR": None}  # value of MKL_CBWR; None: unset (the project sets it)
GEMM = """
import time, torch, torch.nn.functional as F
torch.set_num_threads({threads})
x, w = torch.randn(1024, 512), torch.randn(2048, 512)
for _ in range(5): F.linear(x, w)
best = 1e9
for _ in range(7):
    t = time.perf_counter()
    for _ in range(20): F.linear(x, w)
    best = min(best, (time.perf_counter() - t) / 20)
print(best * 1e3)
"""


def _env(mkl_cbwr: str | None, threads: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    if mkl_cbwr is not None:
        env["MKL_CBWR"] = mkl_cbwr
    env.update(OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    return env


def gemm_ms(mkl_cbwr: str | None, threads: int) -> float:
    code = "import cosmos3_batch\n" + GEMM.format(threads=threads)
    done = subprocess.run([sys.executable, "-c", code], env=_env(mkl_cbwr, threads), capture_output=True,
                          text=True, check=True)  # fmt: skip
    return float(done.stdout.strip())


def run_cli(model: Path, prompts: Path, out: Path, mkl_cbwr: str | None, world: int) -> tuple[float, float]:
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    cmd = [*(launch if world > 1 else [sys.executable]), "-m", "cosmos3_batch", "run", str(prompts)]
    cmd += ["--model", str(model), "--out", str(out), "--save-latents", "--no-progress", "--overwrite"]
    cmd += ["--sp", str(world)] if world > 1 else []
    started = time.perf_counter()
    done = subprocess.run(cmd, env=_env(mkl_cbwr, 1 if world > 1 else 2), capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode:
        raise SystemExit(f"run failed:\n{done.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return max(r["pass_s"] for r in summary["ranks"]), wall


def same_latents(a: Path, b: Path) -> bool:
    files = sorted(p.name for p in a.glob("*.latents.safetensors"))
    return bool(files) and all(
        torch.equal(load_file(a / f)["latents"], load_file(b / f)["latents"]) for f in files
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="a 2-layer hidden-64 model, 2 requests (smoke run)"
    )
    parser.add_argument("--repeats", type=int, default=2, help="runs per setting; the best is reported")
    parser.add_argument("--keep", type=Path, help="keep the model and outputs here")
    args = parser.parse_args()
    folder = args.keep or Path(tempfile.mkdtemp(prefix="bench-numerics-"))
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for threads in (1, 2):
        best = {name: min(gemm_ms(v, threads) for _ in range(args.repeats)) for name, v in SETTINGS.items()}
        rows.append((f"gemm, {threads} thread(s)", "ms/call", best, None))
    layers, hidden, inter = ("2", "64", "128") if args.quick else ("8", "512", "2048")
    model = folder / "model"
    if not (model / "model_index.json").exists():
        make = [sys.executable, "-m", "cosmos3_batch", "make-tiny", str(model), "--layers", layers]
        make += ["--hidden", hidden, "--heads", "8", "--kv-heads", "2", "--intermediate", inter]
        subprocess.run(make, env=_env(None, 2), check=True, capture_output=True)
    requests = [
        {"id": f"v{i}", "prompt": f"scene {i}", "size": "256x256", "num_frames": 9, "num_inference_steps": 2,
         "guidance_scale": 4.0 if i % 2 else 1.0, "seed": i}
        for i in range(2 if args.quick else 8)
    ]  # fmt: skip
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in requests))
    for world in (1, 2):
        passes: dict[str, float] = {}
        walls: dict[str, float] = {}
        for _ in range(args.repeats):
            for name, value in SETTINGS.items():  # alternated, so drift hits both settings alike
                out = folder / f"out-w{world}-{name.replace(' ', '-')}"
                pass_s, wall = run_cli(model, prompts, out, value, world)
                passes[name] = min(passes.get(name, 1e9), pass_s)
                walls[name] = min(walls.get(name, 1e9), wall)
        outs = [folder / f"out-w{world}-{name.replace(' ', '-')}" for name in SETTINGS]
        label = "run, 1 process" if world == 1 else "run, world 2 --sp 2"
        equal = same_latents(*outs)
        rows.append((label, "pass loop s", passes, equal))
        rows.append((label, "wall s", walls, equal))
    print(f"CPU: {cpu_name()}; torch {torch.__version__}; best of {args.repeats}")
    print("| what | unit | MKL default | strict CNR | strict / default | latents equal |")
    print("|---|---|---|---|---|---|")
    for what, unit, value, equal in rows:
        a, b = value["MKL default"], value["strict CNR"]
        flag = "" if equal is None else ("yes" if equal else "no")
        print(f"| {what} | {unit} | {a:.3f} | {b:.3f} | {b / a:.2f} | {flag} |")


if __name__ == "__main__":
    main()
