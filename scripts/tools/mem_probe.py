"""Private memory a rank spends on layer weights, read from /proc (not from our own bookkeeping).

    torchrun --standalone --nproc-per-node 2 scripts/tools/mem_probe.py CKPT MODE OUT.json

MODE: allgather | local | sharded (engine modes) or naive (every rank loads every layer privately).
Each rank measures RssAnon and Pss before and after placing the layer weights, and writes its figures
to OUT.json.rank<R>. It also measures RssAnon across loading the resident (non-layer) weights, and
across one deliberate private copy of the embedding table (what loading must not do).
"""

from __future__ import annotations

import json
import sys
import threading
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


class PeakSampler:
    """Highest RssAnon seen while placing the weights, sampled every millisecond on a thread: /proc keeps a
    peak only for all of RSS (VmHWM), which also counts the page-cache pages a rank reads its shard from."""

    def __init__(self) -> None:
        self.peak = proc_kb("/proc/self/status", "RssAnon") * 1024
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(0.001):
            self.peak = max(self.peak, proc_kb("/proc/self/status", "RssAnon") * 1024)

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        return max(self.peak, proc_kb("/proc/self/status", "RssAnon") * 1024)


def in_file_mapping(address: int, path: Path) -> bool:
    """Whether `address` lies in a mapping of the file at `path` (per /proc/self/maps)."""
    target = str(Path(path).resolve())
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == target:
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                return True
    return False


def main() -> None:
    from cosmos3_batch.checkpoint.folder import Checkpoint
    from cosmos3_batch.engine.transport import OffloadMode
    from cosmos3_batch.model.loading import build_transformer_on_meta, load_transformer
    from cosmos3_batch.parallel.world import init_world, teardown
    from cosmos3_batch.pipeline.passes.weights import build_weights

    ckpt_dir, mode, out = sys.argv[1], sys.argv[2], sys.argv[3]
    world = init_world("cpu", 300)
    ckpt = Checkpoint.open(ckpt_dir)
    store = ckpt.store("transformer")
    build_transformer_on_meta(ckpt.config("transformer"))  # imports diffusers: not part of the figure below
    start = snapshot()
    transformer = load_transformer(ckpt, world.device, with_layers=False)
    loaded = snapshot()
    embed = transformer.embed_tokens.weight
    embed_file = store.file_of("embed_tokens.weight").path
    resident = [n for n in store.names() if not n.startswith(("layers.", "lm_head.", "embed_tokens."))]
    private_copy = store.tensor("embed_tokens.weight")  # the control: a private copy must show up
    copied = snapshot()
    del private_copy
    layer_names = [n for n in store.names() if n.startswith("layers.")]
    layer_bytes = sum(store.byte_view(n).numel() for n in layer_names)
    world.barrier()
    before = snapshot()
    sampler = PeakSampler()
    if mode == "naive":
        held = [store.tensor(n) for n in layer_names]  # noqa: F841 (kept alive for the measurement)
        slot_bytes = 0
    else:
        weights = build_weights(transformer.layers, ckpt, OffloadMode(mode), world)
        slot_bytes = sum(s.numel() for s in weights.engine.slots)
    peak = sampler.stop()
    after = snapshot()
    world.barrier()
    result = {
        "rank": world.rank,
        "world_size": world.world_size,
        "mode": mode,
        "layer_bytes": layer_bytes,
        "slot_bytes": slot_bytes,
        "rss_anon_delta": after["rss_anon"] - before["rss_anon"],
        "rss_anon_peak_delta": peak - before["rss_anon"],
        "pss_delta": after["pss"] - before["pss"],
        "embed_bytes": embed.numel() * embed.element_size(),
        "embed_is_mapped_view": in_file_mapping(embed.data_ptr(), embed_file),
        "resident_other_bytes": sum(store.byte_view(n).numel() for n in resident),
        "resident_rss_anon_delta": loaded["rss_anon"] - start["rss_anon"],
        "private_copy_rss_anon_delta": copied["rss_anon"] - loaded["rss_anon"],
    }
    Path(f"{out}.rank{world.rank}").write_text(json.dumps(result))
    teardown(world)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
