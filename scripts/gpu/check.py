"""One-GPU check of the numbers the design rests on: nothing downloaded, random bf16 weights, < 8 minutes
on one H200. Run it through `bash scripts/gpu_check.sh`, which enforces the time limit.

    python scripts/gpu/check.py [--layers 8] [--budget-s 450] [--tmp /tmp] [--out gpu_check.md]

1. Host->device GB/s for one GEN layer part of Cosmos3-Nano (~386 MB bf16): pageable memory vs memory
   pinned with cudaHostRegister (exactly as the engine pins its arena and staging buffers).
2. GEN-half compute of one Nano-shaped layer (hidden 4096, 32/8 heads, head dim 128, intermediate 12288)
   through our `Cosmos3Split.gen_layer`, timed with CUDA events at 480p and 720p token counts, next to
   the time one fetch of that part takes: how many sequences per pass hide the transfer.
3. Pass time through our engine over L Nano-shaped layers (gpu/check_engine.py): `resident` vs `local`
   and `allgather` at world size 1, K=1 and K=4 requests (two CFG branches each), GEN halves only (the
   steady state: UND cached); stall share from the engine's CUDA events; peak device memory.

Prints markdown tables for docs/benchmarks.md. Synchronizing the device here is for timing only.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for _path in (ROOT, ROOT / "scripts" / "gpu"):  # run as a script from anywhere; its siblings sit here
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from layers import (  # noqa: E402
    VIDEOS,
    Budget,
    branch,
    gen_flops,
    markdown,
    part_bytes,
    random_layer,
    split_for,
    vision_tokens,
)


def fetch_ms(nbytes: int, gbps: float) -> float:
    return nbytes / (gbps * 1e9) * 1e3


def branches_to_hide(fetch: float, compute_per_branch: float) -> int:
    """Sequences a pass must apply to each part so that its compute covers the next part's fetch."""
    return max(1, math.ceil(fetch / compute_per_branch))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--layers", type=int, default=8, help="Nano-shaped layers in the engine check (~772 MB each)"
    )
    parser.add_argument("--budget-s", type=float, default=450.0, help="stop starting sections after this")
    parser.add_argument(
        "--tmp", type=Path, default=Path(tempfile.gettempdir()), help="where the checkpoint goes"
    )
    parser.add_argument(
        "--und-len", type=int, default=256, help="UND (prompt) tokens each GEN token attends to"
    )
    parser.add_argument("--passes", type=int, default=3, help="timed passes per engine configuration")
    parser.add_argument("--out", type=Path, help="also write the tables to this file")
    args = parser.parse_args(argv)
    if args.layers < 2:
        parser.error("--layers must be >= 2 (two slots: a pass needs at least two parts to overlap)")
    return args


# ---- on the GPU ---------------------------------------------------------------------------------------


def h2d_gbps(nbytes: int, device, pinned: bool, reps: int = 5) -> float:
    """Host->device GB/s for one buffer of `nbytes`; pinned = cudaHostRegister'd, as the engine does it."""
    import torch

    from cosmos3_batch.engine.cuda_backend import PinnedRegion

    host = torch.ones(nbytes, dtype=torch.uint8)  # touched: first-touch page faults are not transfer time
    region = PinnedRegion.of_tensor(host) if pinned else None
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    try:
        dst.copy_(host, non_blocking=pinned)
        torch.cuda.synchronize()  # timing only: the warm-up copy is done
        start = time.perf_counter()
        for _ in range(reps):
            dst.copy_(host, non_blocking=pinned)
        torch.cuda.synchronize()  # timing only
        return nbytes * reps / (time.perf_counter() - start) / 1e9
    finally:
        if region is not None:
            region.close()


def gen_layer_ms(layer, tokens: int, und_len: int, device, reps: int = 5) -> float:
    """Milliseconds of one GEN half for one branch, timed with CUDA events."""
    import torch

    split, (seq, hidden) = split_for(1), branch(tokens, und_len, 1, device)
    seq.gen_hidden = hidden
    split.gen_layer(layer, seq, 0)  # warm-up: kernel selection, workspace allocation
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        seq.gen_hidden = hidden  # same input every time: random weights must not drift into inf
        split.gen_layer(layer, seq, 0)
    end.record()
    end.synchronize()  # timing only
    return start.elapsed_time(end) / reps


def transfer_section(gen_bytes: int, device) -> tuple[str, float]:
    pageable, pinned = h2d_gbps(gen_bytes, device, False), h2d_gbps(gen_bytes, device, True)
    rows = [
        ["pageable (plain host memory)", pageable, fetch_ms(gen_bytes, pageable)],
        ["pinned (cudaHostRegister, as the engine)", pinned, fetch_ms(gen_bytes, pinned)],
    ]
    title = f"### Host -> device, one GEN layer part ({gen_bytes / 2**20:.0f} MiB bf16)\n\n"
    return title + markdown(["host memory", "GB/s", "ms per part"], rows), pinned


def compute_section(device, gen_bytes: int, pinned_gbps: float, und_len: int, budget: Budget) -> str:
    layer = random_layer(device)
    fetch = fetch_ms(gen_bytes, pinned_gbps)
    rows = []
    for video in VIDEOS:
        if not budget.allows(60):
            rows.append([video.name, "", "skipped (time budget)", "", "", ""])
            continue
        tokens = vision_tokens(video.width, video.height, video.frames)
        ms = gen_layer_ms(layer, tokens, und_len, device)
        tflops = gen_flops(tokens, und_len) / (ms / 1e3) / 1e12
        rows.append([video.name, tokens, ms, tflops, fetch, branches_to_hide(fetch, ms)])
    del layer
    title = f"### GEN half of one Nano-shaped layer (bf16, {und_len} UND tokens of context), vs its fetch\n\n"
    headers = [
        "video",
        "vision tokens",
        "ms / layer / branch",
        "TFLOP/s",
        "fetch ms (pinned)",
        "branches to hide",
    ]
    return title + markdown(headers, rows)


def describe_device(device) -> str:
    import torch

    props = torch.cuda.get_device_properties(device)
    return (
        f"GPU: {props.name}, {props.total_memory / 2**30:.0f} GiB; torch {torch.__version__}, "
        f"CUDA {torch.version.cuda}; random bf16 weights, Cosmos3-Nano layer shapes"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device is visible; this check needs one NVIDIA GPU "
            "(the CPU benchmark is scripts/bench/offload_modes.py)",
            file=sys.stderr,
        )
        return 2
    budget = Budget(args.budget_s)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    torch.set_grad_enabled(False)
    sections = [describe_device(device)]
    print(sections[-1], flush=True)
    gen_bytes = part_bytes()["gen"]
    table, pinned = transfer_section(gen_bytes, device)
    for section in (lambda: table, lambda: compute_section(device, gen_bytes, pinned, args.und_len, budget)):
        sections.append(section())
        print("\n" + sections[-1], flush=True)  # printed as it comes: a later failure keeps these
    if budget.allows(120):
        from check_engine import engine_section

        sections.append(engine_section(args, device, budget))
    else:
        sections.append("### Engine pass\n\nskipped (time budget)")
    print("\n" + sections[-1], flush=True)
    if args.out:
        args.out.write_text("\n\n".join(sections) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
