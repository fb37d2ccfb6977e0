"""Part layout (pure) and host shards on real safetensors files: exact offsets, sizes and bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from cosmos3_batch.checkpoint.reader import CheckpointFileError, SafetensorsFile, TensorStore
from cosmos3_batch.engine.host import HostShards, local_sources
from cosmos3_batch.engine.layout import ALIGN, ParamSpec, PartLayout, build_part_layout, layout_digest

F32, F16, BF16, I8 = torch.float32, torch.float16, torch.bfloat16, torch.int8


def spec(name: str, dtype: torch.dtype, *shape: int) -> ParamSpec:
    return ParamSpec(name, dtype, tuple(shape))


# f32 and f16 interleaved: groups come out f32 then f16, each in the given order.
MIXED = [spec("a", F32, 7), spec("b", F16, 5), spec("c", F32, 3), spec("d", F16, 2)]


@pytest.mark.parametrize(
    ("world", "total", "shard"), [(1, 1024, 1024), (2, 1024, 512), (3, 1536, 512), (4, 1024, 256)]
)
def test_sizes_not_divisible_by_world(world: int, total: int, shard: int) -> None:
    layout = build_part_layout("0.gen", MIXED, world)
    # f32 group: a at 0 (28 B), c at the next ALIGN (12 B); then the f16 group: b (10 B), d (4 B), each on
    # an ALIGN boundary; 772 bytes, padded to a multiple of world x ALIGN.
    assert [(p.spec.name, p.offset) for p in layout.params] == [("a", 0), ("c", 256), ("b", 512), ("d", 768)]
    assert (layout.nbytes, layout.shard_bytes, layout.payload_bytes) == (total, shard, 28 + 12 + 10 + 4)
    assert layout.nbytes % (world * ALIGN) == 0 and layout.shard_bytes * world == layout.nbytes
    assert [layout.shard_range(r) for r in range(world)] == [
        (r * shard, (r + 1) * shard) for r in range(world)
    ]


def test_mixed_dtypes_offsets_are_aligned() -> None:
    params = [spec("i", I8, 5), spec("w", F32, 3), spec("v", BF16, 3), spec("h", F16, 1), spec("w2", F32, 2)]
    layout = build_part_layout("k", params, 2)
    assert [(p.spec.name, p.offset) for p in layout.params] == [
        ("i", 0),
        ("w", 256),  # after 5 odd bytes of int8
        ("w2", 512),  # the same dtype, still on its own ALIGN boundary
        ("v", 768),
        ("h", 1024),
    ]
    assert layout.nbytes == 1536
    assert [place.spec.dtype for place in layout.params] == [
        I8,
        F32,
        F32,
        BF16,
        F16,
    ]  # first-appearance order
    assert all(place.offset % ALIGN == 0 for place in layout.params) and ALIGN == 256


@pytest.mark.parametrize("shape", [(1,), ()])
def test_part_smaller_than_world(shape: tuple[int, ...]) -> None:
    layout = build_part_layout("tiny", [ParamSpec("s", F32, shape)], 4)
    assert (layout.nbytes, layout.shard_bytes) == (4 * ALIGN, ALIGN)
    assert layout.pieces_for_rank(0) == [(layout.params[0], 0, 4)]
    assert all(layout.pieces_for_rank(r) == [] for r in (1, 2, 3))


def test_empty_part_and_bad_world() -> None:
    assert build_part_layout("e", [], 3).nbytes == 3 * ALIGN
    with pytest.raises(ValueError, match="world_size"):
        build_part_layout("e", [], 0)


def flat_buffer(layout: PartLayout, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The whole part as bytes, built independently of the engine's copy code: zeros plus each param."""
    buf = torch.zeros(layout.nbytes, dtype=torch.uint8)
    for place in layout.params:
        raw = tensors[place.spec.name].contiguous().view(-1).view(torch.uint8)
        buf[place.offset : place.offset + raw.numel()] = raw
    return buf


def random_tensors(specs: list[ParamSpec], seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {s.name: (torch.randn(s.shape, generator=gen) * 50).clamp(-120, 120).to(s.dtype) for s in specs}


STRADDLE = [spec("big", F32, 300), spec("v", BF16, 200), spec("s", F16), spec("z", F32, 0), spec("q", I8, 9)]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 7])
@pytest.mark.parametrize("params", [MIXED, STRADDLE], ids=["mixed", "straddle"])
def test_pieces_cover_every_byte_once(params: list[ParamSpec], world: int) -> None:
    layout = build_part_layout("p", params, world)
    tensors = random_tensors(params)
    buf = flat_buffer(layout, tensors)
    rebuilt = {p.spec.name: torch.zeros(p.spec.nbytes, dtype=torch.uint8) for p in layout.params}
    hits = {p.spec.name: torch.zeros(p.spec.nbytes, dtype=torch.int32) for p in layout.params}
    for rank in range(world):
        lo, hi = layout.shard_range(rank)
        shard = buf[lo:hi]  # all a rank has
        for place, start, stop in layout.pieces_for_rank(rank):
            at = place.offset + start - lo
            rebuilt[place.spec.name][start:stop] = shard[at : at + stop - start]
            hits[place.spec.name][start:stop] += 1
    for place in layout.params:
        s = place.spec
        assert torch.equal(hits[s.name], torch.ones(s.nbytes, dtype=torch.int32)), s.name
        assert torch.equal(rebuilt[s.name].view(s.dtype).reshape(s.shape), tensors[s.name]), s.name


def test_digest() -> None:
    def digest(params: list[ParamSpec], world: int = 2, key: str = "0.und") -> str:
        return layout_digest([build_part_layout(key, params, world)])

    base = [spec("w", F32, 5, 3), spec("x", F32, 4), spec("h", F16, 2)]
    same = digest([spec("w", F32, 5, 3), spec("x", F32, 4), spec("h", F16, 2)])
    assert digest(base) == same
    changed = {
        "shape": [spec("w", F32, 3, 5), *base[1:]],  # same bytes, same offsets
        "dtype": [*base[:2], spec("h", BF16, 2)],  # same item size
        "order": [base[1], base[0], base[2]],
        "name": [spec("W", F32, 5, 3), *base[1:]],
    }
    digests = {what: digest(params) for what, params in changed.items()}
    digests["world"] = digest(base, world=3)
    digests["key"] = digest(base, key="0.gen")
    assert same not in digests.values() and len(set(digests.values())) == len(digests)
    two = [build_part_layout("0.und", base, 2), build_part_layout("0.gen", base[:1], 2)]
    assert layout_digest(two) != layout_digest(two[::-1])


# ---- host.py on real safetensors files ---------------------------------------------------------------

SAVED = [
    spec("a", F32, 5, 3),
    spec("b", BF16, 7),
    spec("c", F16, 1),
    spec("d", F32, 200),
    spec("e", BF16, 300),
]


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    tensors = random_tensors(SAVED, seed=1)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path, tensors


def header_len(path: Path) -> int:
    return int.from_bytes(path.read_bytes()[:8], "little")


@pytest.mark.parametrize("where", ["data", "header", "length"])
def test_truncated_file_is_rejected(saved: tuple[Path, dict], where: str) -> None:
    path = saved[0] / "model.safetensors"
    data = path.read_bytes()
    cut = {"data": len(data) - 1, "header": 8 + header_len(path) // 2, "length": 5}[where]
    path.write_bytes(data[:cut])
    with pytest.raises(CheckpointFileError, match="truncated") as err:
        SafetensorsFile(path)
    assert str(path) in str(err.value)


def test_store_returns_saved_tensors(saved: tuple[Path, dict]) -> None:
    folder, tensors = saved
    store = TensorStore(folder)
    assert sorted(store.names()) == sorted(tensors)
    for name, want in tensors.items():
        got = store.tensor(name)
        assert got.dtype == want.dtype and torch.equal(got, want), name
        assert store.info(name) == (want.dtype, tuple(want.shape))


def test_store_check_names_tensor_and_shapes(saved: tuple[Path, dict]) -> None:
    store = TensorStore(saved[0])
    store.check("a", F32, (5, 3))
    with pytest.raises(CheckpointFileError, match=r"'a' has shape \(5, 3\), the config implies \(3, 5\)"):
        store.check("a", None, (3, 5))
    with pytest.raises(CheckpointFileError, match="'nope' is missing"):
        store.check("nope", None, (1,))
    with pytest.raises(CheckpointFileError, match=r"'b' is torch\.bfloat16, expected torch\.float16"):
        store.check("b", F16, (7,))


def write_index(folder: Path, weight_map: dict[str, str]) -> None:
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )


def test_index_json(tmp_path: Path) -> None:
    tensors = random_tensors(SAVED[:3], seed=2)
    save_file({"a": tensors["a"]}, str(tmp_path / "m-1.safetensors"))
    save_file({"b": tensors["b"], "c": tensors["c"]}, str(tmp_path / "m-2.safetensors"))
    write_index(tmp_path, {"a": "m-1.safetensors", "b": "m-2.safetensors", "c": "m-2.safetensors"})
    store = TensorStore(tmp_path)
    assert all(torch.equal(store.tensor(n), t) for n, t in tensors.items())

    write_index(tmp_path, {"a": "m-1.safetensors", "b": "m-3.safetensors"})
    with pytest.raises(CheckpointFileError, match=r"m-3\.safetensors: listed in .*index\.json but missing"):
        TensorStore(tmp_path)
    write_index(tmp_path, {"a": "m-1.safetensors", "b": "m-1.safetensors"})
    with pytest.raises(
        CheckpointFileError, match=r"m-1\.safetensors: index lists tensor 'b' but the file lacks"
    ):
        TensorStore(tmp_path)


def test_empty_folder(tmp_path: Path) -> None:
    with pytest.raises(CheckpointFileError, match="no safetensors files"):
        TensorStore(tmp_path)


PARTS = [("0.und", ["a", "b", "c"]), ("0.gen", ["d", "e", "c"])]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_host_shards_hold_exactly_the_rank_shard(saved: tuple[Path, dict], world: int) -> None:
    folder, tensors = saved
    store = TensorStore(folder)
    layouts = [
        build_part_layout(key, [ParamSpec(n, *store.info(n)) for n in names], world) for key, names in PARTS
    ]
    refs = [flat_buffer(layout, tensors) for layout in layouts]
    for rank in range(world):
        host = HostShards(layouts, store, rank)
        assert host.arena.numel() == sum(layout.shard_bytes for layout in layouts)  # exact size, one arena
        for index, (layout, ref) in enumerate(zip(layouts, refs, strict=True)):
            lo, hi = layout.shard_range(rank)
            assert torch.equal(host.shard(index), ref[lo:hi]), (rank, layout.key)
            padding = torch.ones(layout.nbytes, dtype=torch.bool)
            for place in layout.params:
                padding[place.offset : place.offset + place.spec.nbytes] = False
            assert not host.shard(index)[padding[lo:hi]].any()  # padding bytes are zero


def test_local_sources_are_whole_params(saved: tuple[Path, dict]) -> None:
    folder, tensors = saved
    store = TensorStore(folder)
    layout = build_part_layout("0.gen", [ParamSpec(n, *store.info(n)) for n in PARTS[1][1]], 3)
    buf = torch.zeros(layout.nbytes, dtype=torch.uint8)
    for piece in local_sources(layout, store):
        buf[piece.offset : piece.offset + piece.data.numel()] = piece.data
    assert torch.equal(buf, flat_buffer(layout, tensors))
