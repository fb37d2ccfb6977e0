"""Safetensors checkpoints, memory-mapped: the reader that model/loading.py and the engine both use.

We read safetensors headers ourselves so that a tensor's bytes are a zero-copy view of the mapped file:
a rank copies only the byte ranges it needs (its shards, its resident weights), and every page it only
reads lives in the page cache that the node's ranks share. `TensorStore.shared_tensor` hands out such a
view for weights that are only ever read on the host (the embedding table), so no rank holds a private
copy of them.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import warnings
from pathlib import Path

import torch

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class CheckpointFileError(ValueError):
    """A safetensors file is missing, truncated, or disagrees with what the model expects."""


class SafetensorsFile:
    """Header-validated, memory-mapped safetensors file."""

    def __init__(self, path: Path):
        self.path = path
        try:
            with open(path, "rb") as f:
                size = f.seek(0, 2)
                f.seek(0)
                if size < 8:
                    raise CheckpointFileError(f"{path}: truncated ({size} bytes, no header)")
                (header_len,) = struct.unpack("<Q", f.read(8))
                if header_len > size - 8:
                    raise CheckpointFileError(
                        f"{path}: truncated (header says {header_len} bytes, file is {size})"
                    )
                header = json.loads(f.read(header_len))
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        except OSError as exc:
            raise CheckpointFileError(f"{path}: cannot read ({exc.strerror or exc})") from exc
        except ValueError as exc:
            if isinstance(exc, CheckpointFileError):
                raise
            raise CheckpointFileError(f"{path}: corrupt safetensors header ({exc})") from exc
        header.pop("__metadata__", None)
        self._base = 8 + header_len
        self.tensors: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            dtype = DTYPES.get(info.get("dtype"))
            start, stop = info["data_offsets"]
            shape = tuple(info["shape"])
            if dtype is None:
                raise CheckpointFileError(
                    f"{path}: tensor '{name}' has unsupported dtype {info.get('dtype')}"
                )
            numel = 1
            for dim in shape:
                numel *= dim
            if stop - start != numel * dtype.itemsize:
                raise CheckpointFileError(
                    f"{path}: tensor '{name}' byte range does not match its shape {shape}"
                )
            if self._base + stop > size:
                raise CheckpointFileError(
                    f"{path}: truncated: tensor '{name}' ends at byte {self._base + stop}, file size {size}"
                )
            self.tensors[name] = (dtype, shape, self._base + start, self._base + stop)
        with warnings.catch_warnings():
            # The map is read-only and we only ever copy out of it; torch warns about any non-writable buffer.
            warnings.simplefilter("ignore", UserWarning)
            self._bytes = (
                torch.frombuffer(self._map, dtype=torch.uint8)
                if self._map
                else torch.empty(0, dtype=torch.uint8)
            )

    def byte_view(self, name: str) -> torch.Tensor:
        _, _, start, stop = self.tensors[name]
        return self._bytes[start:stop]


class TensorStore:
    """Every tensor of one component folder (sharded via the index JSON, or plain files)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        indexes = sorted(self.folder.glob("*.safetensors.index.json"))
        files: dict[str, SafetensorsFile] = {}
        self._where: dict[str, SafetensorsFile] = {}
        if indexes:
            weight_map = json.loads(indexes[0].read_text())["weight_map"]
            for name, file in weight_map.items():
                if file not in files:
                    if not (self.folder / file).is_file():
                        raise CheckpointFileError(
                            f"{self.folder / file}: listed in {indexes[0].name} but missing"
                        )
                    files[file] = SafetensorsFile(self.folder / file)
                if name not in files[file].tensors:
                    raise CheckpointFileError(
                        f"{self.folder / file}: index lists tensor '{name}' but the file lacks it"
                    )
                self._where[name] = files[file]
        else:
            paths = sorted(self.folder.glob("*.safetensors"))
            if not paths:
                raise CheckpointFileError(f"{self.folder}: no safetensors files")
            for path in paths:
                st = SafetensorsFile(path)
                self._where.update(dict.fromkeys(st.tensors, st))

    def names(self) -> list[str]:
        return list(self._where)

    def check(self, name: str, dtype: torch.dtype | None, shape: tuple[int, ...]) -> None:
        st = self._where.get(name)
        if st is None:
            raise CheckpointFileError(f"{self.folder}: tensor '{name}' is missing from the checkpoint")
        have_dtype, have_shape, _, _ = st.tensors[name]
        if tuple(have_shape) != tuple(shape):
            raise CheckpointFileError(
                f"{st.path}: tensor '{name}' has shape {tuple(have_shape)}, the config implies {tuple(shape)}"
            )
        if dtype is not None and have_dtype != dtype:
            raise CheckpointFileError(f"{st.path}: tensor '{name}' is {have_dtype}, expected {dtype}")

    def info(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        if (st := self._where.get(name)) is None:  # a config that names more than the files hold: exit 2
            raise CheckpointFileError(f"{self.folder}: tensor '{name}' is missing from the checkpoint")
        dtype, shape, _, _ = st.tensors[name]
        return dtype, shape

    def byte_view(self, name: str) -> torch.Tensor:
        return self._where[name].byte_view(name)

    def tensor(self, name: str) -> torch.Tensor:
        """A private copy (for resident weights), in the checkpoint's dtype and shape."""
        dtype, shape = self.info(name)
        return self.byte_view(name).clone().view(dtype).reshape(shape)

    def shared_tensor(self, name: str) -> torch.Tensor:
        """A read-only view of the mapped file (no copy: the pages are the node's shared page cache).

        Writing to it is undefined (the map is read-only: a write faults). Alignment: safetensors does not
        promise it, so a tensor whose offset is not a multiple of its item size is copied instead."""
        dtype, shape = self.info(name)
        raw = self.byte_view(name)
        if raw.data_ptr() % dtype.itemsize:
            return raw.clone().view(dtype).reshape(shape)
        return raw.view(dtype).reshape(shape)

    def row_reader(self, name: str) -> RowReader:
        """Rows of 2-D tensor `name` read with pread: see RowReader."""
        dtype, shape, start, _ = self._where[name].tensors[name]
        return RowReader(self._where[name].path, start, dtype, shape)

    def mapped_files(self) -> list[SafetensorsFile]:
        return list(dict.fromkeys(self._where.values()))

    def file_of(self, name: str) -> SafetensorsFile:
        return self._where[name]


class RowReader:
    """Rows of a 2-D tensor (the token embedding table) read from its file with pread, not through the map.

    The table is looked up on the host for every admission: a load from the mapping after the file was
    truncated under the job would be a SIGBUS. pread returns short instead: the missing bytes read as zeros
    (counted), and the checkpoint watch stops the job after the pass, before anything computed from them
    is written. A row is a few KiB; a prompt a few
    hundred rows: microseconds next to a denoising step. The result equals `weight[ids]` bit for bit."""

    def __init__(self, path: Path, offset: int, dtype: torch.dtype, shape: tuple[int, ...]):
        if len(shape) != 2:
            raise ValueError(f"{path}: row reads need a 2-D tensor, got shape {shape}")
        self.path, self.offset, self.dtype, self.shape = path, offset, dtype, shape
        self.row_bytes = shape[1] * dtype.itemsize
        self.short_reads = 0

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).tolist()
        unique = sorted(set(flat))
        if unique and not (unique[0] >= 0 and unique[-1] < self.shape[0]):
            raise IndexError(f"token id out of range for the {self.shape[0]}-row embedding table")
        rows = torch.empty(len(unique), self.shape[1], dtype=self.dtype)
        view = memoryview(rows.view(torch.uint8).numpy()).cast("B")
        # Opened per lookup (microseconds): no descriptor outlives the call, however many jobs a process runs.
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            for i, row in enumerate(unique):
                at, want = (
                    self.offset + row * self.row_bytes,
                    view[i * self.row_bytes : (i + 1) * self.row_bytes],
                )
                got = os.preadv(fd, [want], at)
                if got != self.row_bytes:  # truncated under the job: the watch discards this pass (see above)
                    want[got:] = bytes(self.row_bytes - got)
                    self.short_reads += 1
        finally:
            os.close(fd)
        where = {row: i for i, row in enumerate(unique)}
        index = torch.tensor([where[t] for t in flat], dtype=torch.long)
        return rows[index].reshape(*ids.shape, self.shape[1])
