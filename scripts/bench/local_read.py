"""What `--offload local` pays for reading layer parts with pread instead of copying them out of the mapping.

    python scripts/bench/local_read.py [--mib 256] [--part-mib 16] [--repeat 5]

Writes a safetensors file of float32 tensors of --part-mib each (--mib in all), reads it once so that it
is in the page cache (as a node's ranks find it), then per repeat copies every tensor into one part-sized
buffer both ways, alternating: `copy_` from the tensor's mapped bytes (what local mode did) and
`FileReader.read` (pread into the buffer: what it does now, so that a truncated file reads short instead
of raising SIGBUS). Prints GB/s per way and the ratio; nothing is asserted. On a GPU the part then goes
host -> device, which the two ways share.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from cosmos3_batch.checkpoint.reader import TensorStore
from cosmos3_batch.engine.host import FileReader, LocalPiece


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--part-mib", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        count, numel = args.mib // args.part_mib, args.part_mib * 2**20 // 4
        save_file({f"p{i}": torch.randn(numel) for i in range(count)}, str(Path(folder) / "m.safetensors"))
        store = TensorStore(Path(folder))
        pieces = []
        for name in store.names():
            file = store.file_of(name)
            pieces.append(LocalPiece(store.byte_view(name), 0, file.path, file.tensors[name][2]))
        reader = FileReader([p.path for p in pieces])
        buf = torch.empty(numel * 4, dtype=torch.uint8)
        for piece in pieces:  # into the page cache, and the mapping's pages faulted in once
            buf.copy_(piece.data)

        def mapped() -> None:
            for piece in pieces:
                buf.copy_(piece.data)

        def pread() -> None:
            for piece in pieces:
                reader.read(piece, buf)

        times: dict[str, list[float]] = {"mmap copy_": [], "pread": []}
        for _ in range(args.repeat):
            for name, way in (("mmap copy_", mapped), ("pread", pread)):
                start = time.perf_counter()
                way()
                times[name].append(time.perf_counter() - start)
        reader.close()
    total = count * numel * 4
    print(f"{count} parts of {args.part_mib} MiB from the page cache, {args.repeat} repeats (median)")
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, seconds in medians.items():
        print(f"  {name:<11} {total / seconds / 1e9:6.2f} GB/s")
    print(f"  pread / mmap copy_ time: {medians['pread'] / medians['mmap copy_']:.2f}")


if __name__ == "__main__":
    main()
