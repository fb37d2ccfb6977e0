"""Multi-rank paths on one GPU: what gpu/check.py cannot show with a single process (issue 21, item 13).

    python scripts/gpu/multi_rank.py [--device cuda:0] [--tmp DIR] [--out multi_rank.md]

1. Two ranks on one GPU through gloo (`--device cuda:0`: NCCL refuses two ranks on a device, so layer parts
   are gathered in host memory and copied whole, engine/offload.py) against one process on that GPU, on the
   tiny model in float32: the multi-rank stream/event path of CudaBackend on a real device. Per-branch
   calls (`--no-batch-branches`) must give bit-identical latents: every request runs the same kernels on
   the same shapes whichever rank runs it. With batched branches (the GPU default) a row's GEMM may see
   other rows, so the table shows the largest difference instead of asserting none.
   Read: "identical" = requests whose latents equal the single process bit for bit, of all requests.
2. Host<->device synchronizations per pass, counted by torch's sync debug mode in one in-process job on
   the GPU (main thread; the finisher thread's decode copies are its own): the pass phases must show 0.
   Read: one row per phase, syncs in total and per pass; "where" names the first call site seen.
3. The batched row budget at 720p: peak device memory of one Nano-shaped GEN half applied to K=4 CFG
   requests (8 branches) with `--max-batch-rows` (65,536) against plan's transient for the same call
   (plan/device_memory.py), at 832x480x29 (one group of 8) and 1280x720x189 (8 groups of one).
   Read: measured / plan near or below 1 means plan does not undercount.

Prints markdown tables (for docs/benchmarks.md). Nothing is downloaded: the tiny model is made here.
With `--device cpu` every section but 3 runs on the CPU: a dry run of the plumbing (sync counts are then 0
by construction).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import traceback
import warnings
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for _path in (ROOT, ROOT / "scripts" / "gpu"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from layers import NANO, branch, markdown, random_layer, split_for, vision_tokens  # noqa: E402

REQUESTS = [  # images and videos, CFG on and off, different step counts: passes that differ per rank
    {"id": "i0", "prompt": "a red cube", "size": "64x64", "num_frames": 1, "num_inference_steps": 4},
    {"id": "v0", "prompt": "a lighthouse", "size": "64x32", "num_frames": 9, "num_inference_steps": 3},
    {
        "id": "i1",
        "prompt": "snow",
        "size": "32x64",
        "num_frames": 1,
        "num_inference_steps": 5,
        "guidance_scale": 1.0,
    },
    {"id": "v1", "prompt": "waves at night", "size": "32x32", "num_frames": 5, "num_inference_steps": 4},
]


def run_job(args: list[str], nproc: int, env: dict) -> None:
    cmd = [sys.executable, "-m", "cosmos3_batch", *args]
    if nproc > 1:
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        cmd = [*launch, "-m", "cosmos3_batch", *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-3000:]}")


def compare(ref: Path, out: Path) -> tuple[int, float]:
    """(requests whose latents equal the reference bit for bit, largest absolute difference)."""
    import torch
    from safetensors.torch import load_file

    same, worst = 0, 0.0
    for request in REQUESTS:
        a = load_file(str(ref / f"{request['id']}.latents.safetensors"))["latents"]
        b = load_file(str(out / f"{request['id']}.latents.safetensors"))["latents"]
        same += int(torch.equal(a, b))
        worst = max(worst, (a.double() - b.double()).abs().max().item())
    return same, worst


def two_ranks_section(device: str, tmp: Path) -> str:
    model, prompts = tmp / "tiny", tmp / "requests.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in REQUESTS))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    run_job(["make-tiny", str(model)], 1, env)
    common = [str(prompts), "--model", str(model), "--device", device, "--save-latents", "--no-progress"]
    rows = []
    for batched in ("--no-batch-branches", "--batch-branches"):
        ref, two = tmp / f"one{batched}", tmp / f"two{batched}"
        run_job(["run", *common, batched, "--out", str(ref)], 1, env)
        run_job(["run", *common, batched, "--out", str(two)], 2, env)
        ranks = json.loads((two / "summary.json").read_text())["ranks"]
        same, worst = compare(ref, two)
        gathers = "/".join(str(r["gathers"]) for r in ranks)
        h2d = "/".join(str(r["h2d_bytes"]) for r in ranks)
        rows.append([f"2 ranks on {device}, {batched}", f"{same}/{len(REQUESTS)}", worst, gathers, h2d])
    title = "### Two ranks on one GPU through gloo (staged gathers) vs one process, tiny model, float32\n\n"
    headers = ["run", "identical", "max abs diff", "gathers per rank", "H2D bytes per rank"]
    return title + markdown(headers, rows)


class SyncCounter:
    """Counts torch's 'called a synchronizing CUDA operation' warnings on the main thread, per phase."""

    def __init__(self) -> None:
        self.phase = "outside passes"
        self.counts: Counter[str] = Counter()
        self.where: dict[str, str] = {}
        self.passes = 0

    def showwarning(self, message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" not in str(message) or threading.current_thread() is not threading.main_thread():
            return
        self.counts[self.phase] += 1
        ours = [
            f
            for f in traceback.extract_stack()[:-1]
            if "cosmos3_batch" in f.filename or "diffusers" in f.filename
        ]
        if ours and self.phase not in self.where:
            self.where[self.phase] = f"{Path(ours[-1].filename).name}:{ours[-1].lineno} {ours[-1].name}"

    def wrap(self, cls, name: str, phase: str, counts_pass: bool = False) -> None:
        original = getattr(cls, name)
        counter = self

        def wrapped(self_, *args, **kwargs):
            outer, counter.phase = counter.phase, phase
            counter.passes += counts_pass
            try:
                return original(self_, *args, **kwargs)
            finally:
                counter.phase = outer

        setattr(cls, name, wrapped)


def sync_section(device: str, tmp: Path) -> str:
    import torch

    from cosmos3_batch.cli import app
    from cosmos3_batch.pipeline.passes.runner import PassRunner

    counter = SyncCounter()
    counter.wrap(PassRunner, "_admit", "admission (per request, not per pass)")
    counter.wrap(PassRunner, "_begin", "pass: embed")
    counter.wrap(PassRunner, "_pass", "pass: layers", counts_pass=True)
    counter.wrap(PassRunner, "_finish", "pass: heads + scheduler steps")
    prompts = tmp / "requests.jsonl"
    args = ["run", str(prompts), "--model", str(tmp / "tiny"), "--device", device, "--out", str(tmp / "sync")]
    if device != "cpu":
        torch.cuda.set_sync_debug_mode("warn")
    saved = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = counter.showwarning
        try:
            app([*args, "--no-progress"], standalone_mode=False)
        finally:
            warnings.showwarning = saved
            if device != "cpu":
                torch.cuda.set_sync_debug_mode("default")
    passes = max(1, counter.passes)
    phases = [
        "pass: embed",
        "pass: layers",
        "pass: heads + scheduler steps",
        "admission (per request, not per pass)",
    ]
    rows = [[p, counter.counts[p], counter.counts[p] / passes, counter.where.get(p, "")] for p in phases]
    rows.append(
        [
            "elsewhere on the main thread (load, end)",
            counter.counts["outside passes"],
            "",
            counter.where.get("outside passes", ""),
        ]
    )
    title = f"### Host-device synchronizations on the main thread, {counter.passes} passes ({device})\n\n"
    return title + markdown(["phase", "syncs", "per pass", "where (first seen)"], rows)


def row_budget_section(device: str) -> str:
    import torch

    from cosmos3_batch.model.batched import gen_layer_batched, row_groups
    from cosmos3_batch.plan.device_memory import activation_bytes
    from cosmos3_batch.plan.model_shape import ModelShape
    from cosmos3_batch.plan.row_budget import MAX_BATCH_ROWS

    shape = ModelShape(
        layers=1,
        hidden=NANO.hidden,
        intermediate=NANO.intermediate,
        heads=NANO.heads,
        kv_heads=NANO.kv_heads,
        head_dim=NANO.head_dim,
        act_bytes=2,
        parts=(),
        host_resident_bytes=0,
        device_resident_bytes=0,
        vae_bytes=0,
    )  # only what the transient reads: one Nano layer in bf16
    layer, split, und, rows = random_layer(device), split_for(1), 256, []
    for name, (w, h, f) in (("832x480x29", (832, 480, 29)), ("1280x720x189", (1280, 720, 189))):
        tokens = vision_tokens(w, h, f)
        branches = [branch(tokens, und, 1, device) for _ in range(8)]
        for seq, hidden in branches:
            seq.gen_hidden = hidden
        seqs = [seq for seq, _ in branches]
        groups = row_groups(seqs, [tokens] * len(seqs), MAX_BATCH_ROWS)
        torch.cuda.synchronize(device)  # measuring only
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        for group in groups:
            gen_layer_batched(split, layer, group, 0)
        torch.cuda.synchronize(device)
        measured = torch.cuda.max_memory_allocated(device) - base
        _, planned = activation_bytes(shape, [(2, und, tokens)] * 4, MAX_BATCH_ROWS)
        rows.append([name, tokens, len(groups), measured / 2**30, planned / 2**30, measured / planned])
        del branches, seqs, groups
        torch.cuda.empty_cache()
    title = (
        f"### Batched GEN half, K=4 with CFG (8 branches), --max-batch-rows {MAX_BATCH_ROWS}, Nano bf16\n\n"
    )
    headers = ["video", "rows per branch", "calls", "measured transient GiB", "plan GiB", "measured / plan"]
    return title + markdown(headers, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--device", default="cuda:0", help="cuda:N (every rank on GPU N), or cpu for a dry run"
    )
    parser.add_argument("--tmp", type=Path, default=Path(tempfile.gettempdir()), help="where files go")
    parser.add_argument("--out", type=Path, help="also write the tables to this file")
    args = parser.parse_args(argv)
    import torch

    torch.set_grad_enabled(False)
    tmp = Path(tempfile.mkdtemp(prefix="multi-rank-", dir=args.tmp))
    sections = []
    builders = [lambda: two_ranks_section(args.device, tmp), lambda: sync_section(args.device, tmp)]
    if args.device != "cpu":
        builders.append(lambda: row_budget_section(torch.device(args.device)))
    for build in builders:
        try:
            sections.append(build())
        except Exception as exc:  # one failed section must not hide the others' tables
            sections.append(f"### section failed\n\n{type(exc).__name__}: {str(exc)[-2000:]}")
        print("\n" + sections[-1], flush=True)
    if args.out:
        args.out.write_text("\n\n".join(sections) + "\n")
    return 0 if not any(s.startswith("### section failed") for s in sections) else 1


if __name__ == "__main__":
    sys.exit(main())
