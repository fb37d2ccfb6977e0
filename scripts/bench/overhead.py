"""Host time the engine spends per layer part per pass, without compute (issue: < 0.2 ms per part).

    python scripts/bench/overhead.py [--model DIR] [--passes 200] [--mode allgather]

Walks every part of the tiny (or given) model through begin_pass/acquire in a single process, the way
the runner does, and reports the mean host time per part split into: waiting for the fetch (the
copy itself, on the worker thread) and everything else (bookkeeping, parameter re-pointing, submit).
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    from cosmos3_batch.checkpoint.folder import Checkpoint
    from cosmos3_batch.engine.transport import OffloadMode
    from cosmos3_batch.model.loading import load_transformer
    from cosmos3_batch.model.tiny import ensure_default_tiny
    from cosmos3_batch.parallel.world import World
    from cosmos3_batch.pipeline.passes.weights import build_weights

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--passes", type=int, default=200)
    parser.add_argument("--mode", default="allgather", choices=["allgather", "local", "sharded"])
    args = parser.parse_args()
    ckpt = Checkpoint.open(args.model or ensure_default_tiny())
    transformer = load_transformer(ckpt, torch.device("cpu"), with_layers=False)
    weights = build_weights(transformer.layers, ckpt, OffloadMode(args.mode), World())
    engine = weights.engine
    order = list(range(len(engine.layouts)))
    for _ in range(10):  # warm up the worker thread and the allocator
        engine.begin_pass(order)
        for index in order:
            engine.acquire(index)
        engine.end_pass()
    start, stall = time.perf_counter(), 0.0
    for _ in range(args.passes):
        engine.begin_pass(order)
        for index in order:
            engine.acquire(index)
        stall += engine.end_pass().stall_s
    total = time.perf_counter() - start
    parts = args.passes * len(order)
    part_bytes = sum(layout.nbytes for layout in engine.layouts) / len(order)
    print(f"{len(order)} parts of {part_bytes / 1024:.0f} KiB, {args.passes} passes, mode {args.mode}")
    print(f"host time per part: {1e3 * total / parts:.4f} ms")
    print(f"  waiting for the fetch (copy on the worker): {1e3 * stall / parts:.4f} ms")
    print(f"  engine bookkeeping (re-point, submit, return): {1e3 * (total - stall) / parts:.4f} ms")
    weights.close()


if __name__ == "__main__":
    main()
