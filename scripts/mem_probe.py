"""Private memory a rank spends on layer weights, read from /proc (not from our own bookkeeping).

    torchrun --standalone --nproc-per-node 2 scripts/mem_probe.py CKPT MODE OUT.json

MODE: allgather | local | sharded (engine modes) or naive (every rank loads every layer privately).
Each rank measures RssAnon and Pss before and after placing the layer weights, and writes its figures
to OUT.json.rank<R>.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def proc_kb(path: str, key: str) -> int:
    for line in Path(path).read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def snapshot() -> dict[str, int]:
    return {
        "rss_anon": proc_kb("/proc/self/status", "RssAnon") * 1024,
        "pss": proc_kb("/proc/self/smaps_rollup", "Pss") * 1024,
    }


def main() -> None:
    from cosmos3_batch.dist import init_world, teardown
    from cosmos3_batch.engine.transport import OffloadMode
    from cosmos3_batch.model.loading import Checkpoint, load_transformer
    from cosmos3_batch.pipeline.weights import build_weights

    ckpt_dir, mode, out = sys.argv[1], sys.argv[2], sys.argv[3]
    world = init_world("cpu", 300)
    ckpt = Checkpoint.open(ckpt_dir)
    transformer = load_transformer(ckpt, world.device, with_layers=False)
    store = ckpt.store("transformer")
    layer_names = [n for n in store.names() if n.startswith("layers.")]
    layer_bytes = sum(store.byte_view(n).numel() for n in layer_names)
    world.barrier()
    before = snapshot()
    if mode == "naive":
        held = [store.tensor(n) for n in layer_names]  # noqa: F841 (kept alive for the measurement)
        slot_bytes = 0
    else:
        weights = build_weights(transformer.layers, ckpt, OffloadMode(mode), world)
        slot_bytes = sum(s.numel() for s in weights.engine.slots)
    after = snapshot()
    world.barrier()
    result = {
        "rank": world.rank,
        "world_size": world.world_size,
        "mode": mode,
        "layer_bytes": layer_bytes,
        "slot_bytes": slot_bytes,
        "rss_anon_delta": after["rss_anon"] - before["rss_anon"],
        "pss_delta": after["pss"] - before["pss"],
    }
    Path(f"{out}.rank{world.rank}").write_text(json.dumps(result))
    teardown(world)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
