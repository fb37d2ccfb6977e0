"""`convert --fp8`: a bf16/fp32 checkpoint -> a ModelOpt-layout FP8 one, one tensor at a time.

Every decoder-layer linear weight becomes e4m3 with ModelOpt's per-tensor max calibration (model/fp8.py:
`scale = amax / 448`, the bytes `mtq.quantize(FP8_DEFAULT_CFG)` + `mtq.compress` write; a test holds this
when nvidia-modelopt is installed), with its `weight_quantizer._amax` and `._scale` written next to it in
the same file. Everything else (embeddings, norms, proj_in/out, the time embedder: the modules the layer
offload does not move) is copied byte for byte. The other components are copied as they are.

Streaming: each output file's header is computed from the source headers alone, then tensors are written
in order, each read from the memory-mapped source, quantized and dropped: peak memory is about one tensor
(a few copies of it, in its own dtype), never the model. There are no input (activation) scales: without
calibration data there is nothing honest to write, so W8A8 quantizes activations per tensor on the fly
(model/fp8.py).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from cosmos3_batch.checkpoint.folder import Checkpoint, CheckpointError
from cosmos3_batch.checkpoint.fp8_format import AMAX, FP8, QUANT_METHOD, SCALE, quantize_per_tensor
from cosmos3_batch.checkpoint.guardrail_cache import DERIVED_MARKER, MAKE_TINY_MARKER
from cosmos3_batch.checkpoint.reader import DTYPES, SafetensorsFile

DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


@dataclass(frozen=True)
class ConvertReport:
    quantized: int  # linear weights written as e4m3
    copied: int  # tensors copied unchanged
    source_bytes: int  # transformer tensor bytes before
    target_bytes: int  # ... and after


def _policy() -> dict:
    # The step policy NVIDIA's FP8 releases carry, so `--fp8-compute checkpoint` behaves as on theirs.
    from diffusers.pipelines.cosmos.mixed_precision import FIRST_LAST_N_FP8_POLICY

    return dict(FIRST_LAST_N_FP8_POLICY)


def quantization_entry() -> dict:
    """The `quantization_config` written into transformer/config.json."""
    return {
        "quant_method": QUANT_METHOD,
        "quant_type": "FP8",
        "quant_algo": "FP8",
        "weight_only": False,
        "runtime": {"diffusion_step_policy": _policy()},
        "producer": "cosmos3-batch convert --fp8 (per-tensor max calibration, no input scales)",
    }


Entry = tuple[str, torch.dtype, tuple[int, ...], Callable[[], torch.Tensor]]


def _entries(src: SafetensorsFile, targets: set[str]) -> Iterator[Entry]:
    """(name, dtype, shape, producer) in output order. A weight's amax/scale follow it, and are produced
    by the weight's producer (held in `cache`), so each source tensor is read and quantized once."""
    cache: dict[str, torch.Tensor] = {}

    def raw(name: str) -> Callable[[], torch.Tensor]:
        return lambda: src.byte_view(name)

    def quantized(name: str) -> Callable[[], torch.Tensor]:
        def produce() -> torch.Tensor:
            dtype, shape, _, _ = src.tensors[name]
            weight = src.byte_view(name).view(dtype).reshape(shape)
            q, amax, scale = quantize_per_tensor(weight)
            cache["amax"], cache["scale"] = amax, scale
            return q.view(torch.uint8).reshape(-1)

        return produce

    for name, (dtype, shape, _, _) in src.tensors.items():
        if name in targets:
            base = name[: -len(".weight")]
            yield name, FP8, shape, quantized(name)
            # In the source dtype, as ModelOpt stores them (bf16 scales for a bf16 model).
            yield f"{base}.{AMAX}", dtype, (), lambda: cache.pop("amax").reshape(1).view(torch.uint8)
            yield f"{base}.{SCALE}", dtype, (), lambda: cache.pop("scale").reshape(1).view(torch.uint8)
        else:
            yield name, dtype, shape, raw(name)


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    numel = 1
    for dim in shape:
        numel *= dim
    return numel * dtype.itemsize


def write_streaming(path: Path, entries: list[Entry]) -> int:
    """A safetensors file whose header is known up front; tensors written one by one. Returns data bytes."""
    header, offset = {}, 0
    for name, dtype, shape, _ in entries:
        size = _nbytes(dtype, shape)
        header[name] = {
            "dtype": DTYPE_NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format pads the header so the data starts 8-byte aligned
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        for name, dtype, shape, produce in entries:
            data = produce().contiguous()
            assert data.numel() == _nbytes(dtype, shape), name  # the header promised this size
            f.write(data.numpy().data)  # a view: no second copy of the tensor
    os.replace(tmp, path)  # a killed conversion leaves no file that looks complete
    return offset


def _copy_rest(src: Path, dst: Path) -> None:
    for item in sorted(src.iterdir()):
        if item.name == "transformer" or item.name.startswith(".written-by"):
            if item.name == MAKE_TINY_MARKER:  # still a test model: no guardrails by default, not make-tiny's
                (dst / DERIVED_MARKER).write_text(f"converted from {src}, which make-tiny wrote\n")
            continue
        if item.is_dir():
            shutil.copytree(item, dst / item.name)
        else:
            shutil.copy2(item, dst / item.name)


def _check_target(src: Path, dst: Path) -> None:
    if dst.resolve() == src.resolve():
        raise CheckpointError(f"DST {dst} is the source checkpoint")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise CheckpointError(f"DST {dst}: exists and is not an empty folder (nothing was written)")


def convert_fp8(
    src: str | Path, dst: str | Path, linear_weights: Callable[[dict], set[str]]
) -> ConvertReport:
    """Write DST, an FP8 copy of checkpoint SRC. CheckpointError (before any write) for bad input.

    `linear_weights(transformer_config)` names the tensors to quantize: the model knows which weights are
    linears (model/loading.py `decoder_linear_weights`), the checkpoint wing only how to store them."""
    src, dst = Path(src), Path(dst)
    ckpt = Checkpoint.open(src)
    config = ckpt.config("transformer")
    if config.get("quantization_config"):
        raise CheckpointError(f"{src}/transformer: already quantized ({config['quantization_config']!r})")
    _check_target(src, dst)
    store = ckpt.store("transformer")  # header-checked (truncation, shapes) before anything is written
    targets = linear_weights(config)
    dst.mkdir(parents=True, exist_ok=True)
    _copy_rest(src, dst)
    out = dst / "transformer"
    out.mkdir()
    counts = {"quantized": 0, "copied": 0, "source": 0, "target": 0}
    weight_map: dict[str, str] = {}
    for st in store.mapped_files():
        entries = list(_entries(st, targets))
        counts["target"] += write_streaming(out / st.path.name, entries)
        counts["source"] += sum(_nbytes(dtype, shape) for dtype, shape, _, _ in st.tensors.values())
        counts["quantized"] += sum(1 for name in st.tensors if name in targets)
        counts["copied"] += sum(1 for name in st.tensors if name not in targets)
        weight_map.update(dict.fromkeys((e[0] for e in entries), st.path.name))
    for index in sorted((src / "transformer").glob("*.safetensors.index.json")):
        doc = json.loads(index.read_text())
        doc["weight_map"] = weight_map
        doc.setdefault("metadata", {})["total_size"] = counts["target"]
        (out / index.name).write_text(json.dumps(doc, indent=2))
    config["quantization_config"] = quantization_entry()
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return ConvertReport(counts["quantized"], counts["copied"], counts["source"], counts["target"])
