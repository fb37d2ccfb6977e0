"""Section 3 of gpu/check.py: pass time through the engine over Nano-shaped layers, per offload mode.

The layers are written to a temporary safetensors checkpoint (the page cache keeps it warm, as on a node).
`resident` vs `local` and `allgather` at world size 1, K=1 and K=4 requests (two CFG branches each), GEN
halves only (the steady state: UND K/V cached). x resident = offloaded pass time / resident pass time (1.0:
the transfer is hidden). Stall share: the engine's own counters, from CUDA events (stall / (stall +
compute) on the compute stream). Synchronizing the device here is for wall-clock timing only.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from layers import (
    NANO,
    Budget,
    LayerShape,
    branch,
    build_layer,
    markdown,
    part_bytes,
    random_layer,
    split_for,
    sync,
    vision_tokens,
)


def write_checkpoint(folder: Path, layers) -> None:
    """The layers as a diffusers-style transformer folder of safetensors files (one per layer)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    for index, layer in enumerate(layers):
        tensors = {f"layers.{index}.{name}": p.detach().cpu() for name, p in layer.named_parameters()}
        save_file(tensors, str(folder / f"layers-{index:05d}.safetensors"))


def engine_weights(mode: str, layers, root: Path, count: int, device, shape: LayerShape = NANO):
    """The product's own `build_weights`: resident over the GPU layers, or the engine over meta layers."""
    from types import SimpleNamespace

    import torch

    from cosmos3_batch.checkpoint.reader import TensorStore
    from cosmos3_batch.engine.transport import OffloadMode
    from cosmos3_batch.parallel.world import World
    from cosmos3_batch.pipeline.passes.weights import build_weights

    if mode != "resident":  # the engine re-points every parameter of these at its device slots
        layers = torch.nn.ModuleList(build_layer(shape) for _ in range(count))
    checkpoint = SimpleNamespace(store=lambda component: TensorStore(root / component))
    return build_weights(layers, checkpoint, OffloadMode(mode), World(device=device))


def pass_seconds(weights, split, branches: list, layers: int, passes: int, device) -> tuple[float, float]:
    """(seconds per pass, stall share) of GEN-only passes (the steady state: UND K/V cached). The stall
    share is the engine's: CUDA event pairs on the compute stream, read by end_pass/collect, no extra sync."""
    from cosmos3_batch.engine.transport import Counters
    from cosmos3_batch.model.cosmos3 import GEN

    def one_pass():
        for seq, hidden in branches:
            seq.gen_hidden = hidden
        weights.begin_pass(False)
        for index in range(layers):
            layer = weights.layer(index, GEN)
            for seq, _ in branches:
                split.gen_layer(layer, seq, index)
        return weights.end_pass()

    one_pass()
    sync(device)  # warm-up (kernel selection, first touches) is done
    weights.collect()  # ... and its times are read and dropped
    counters, start = Counters(), time.perf_counter()
    for _ in range(passes):
        counters.add(one_pass())
    sync(device)
    total = time.perf_counter() - start
    counters.add(weights.collect())  # the passes whose events completed after their end_pass
    return total / passes, counters.stall_share


def mode_rows(mode: str, gpu_layers, root: Path, args: argparse.Namespace, device) -> list[dict]:
    import torch

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    weights = engine_weights(mode, gpu_layers, root, args.layers, device)
    split, tokens, rows = split_for(args.layers), vision_tokens(832, 480, 29), []
    try:
        for k in (1, 4):  # K requests, each with a cond and an uncond branch
            branches = [branch(tokens, args.und_len, args.layers, device) for _ in range(2 * k)]
            pass_s, stall = pass_seconds(weights, split, branches, args.layers, args.passes, device)
            rows.append({"mode": mode, "K": k, "pass_s": pass_s, "stall": stall})
            del branches
    finally:
        weights.close()
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    return [{**row, "peak_gib": peak} for row in rows]


def engine_table(rows: list[dict], layers: int) -> str:
    base = {row["K"]: row["pass_s"] for row in rows if row["mode"] == "resident"}
    table = [
        [
            row["mode"],
            row["K"],
            row["pass_s"] / layers * 1e3,
            row["pass_s"] / row["K"] * 1e3,
            row["pass_s"] / base[row["K"]] if row["K"] in base else "",
            row["stall"],
            row["peak_gib"],
        ]
        for row in rows
    ]
    headers = ["mode (N=1)", "K", "ms / layer", "ms / request-step", "x resident", "stall share", "peak GiB"]
    return markdown(headers, table)


def engine_section(args: argparse.Namespace, device, budget: Budget) -> str:
    import torch

    need = args.layers * sum(part_bytes().values())
    title = (
        f"### Engine pass over {args.layers} Nano-shaped layers, GEN halves, 480p 29 frames "
        f"({vision_tokens(832, 480, 29)} tokens), 2 CFG branches per request\n\n"
    )
    root = Path(tempfile.mkdtemp(prefix="cosmos3-gpu-check-", dir=args.tmp))
    try:
        if shutil.disk_usage(root).free < 1.2 * need:
            return title + f"skipped: the checkpoint needs {need / 2**30:.1f} GiB free in {args.tmp}"
        gpu_layers = torch.nn.ModuleList(random_layer(device) for _ in range(args.layers))
        write_checkpoint(root / "transformer", gpu_layers)
        rows = []
        for mode in ("resident", "local", "allgather"):
            if not budget.allows(60):
                print(f"gpu_check: {mode} skipped (time budget)", file=sys.stderr)
                continue
            rows += mode_rows(mode, gpu_layers, root, args, device)
            gpu_layers = None  # resident is done: free its weights before the offload modes run
        return title + engine_table(rows, args.layers)
    finally:
        shutil.rmtree(root, ignore_errors=True)
