"""torchrun worker for test_engine_toy.py: a toy 3-layer model whose weights only `LayerOffload` provides.

Every rank builds the model on the meta device, runs two passes (all parts, then GEN parts only) per mode,
checks each part against the true tensors right after `acquire`, and writes `<out>/rank<r>.json`.

Scenarios: `ok` (modes allgather, sharded, local, and staged: allgather as ranks sharing one GPU run it);
`shape` (rank 1 has its own checkpoint and model with one parameter of another shape); `world` /
`world_less` (rank 1 configures the engine with world_size +/- 1).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record

from cosmos3_batch.checkpoint.reader import TensorStore
from cosmos3_batch.engine.offload import LayerOffload, OffloadConfig, PartBinding
from cosmos3_batch.engine.transport import OffloadMode

NUM_LAYERS = 3
# part -> (Linear weight (out, in) in float32, bfloat16 vector length); a float16 one-element tensor too.
SHAPES: dict[str, tuple[tuple[int, int], int]] = {"und": ((5, 3), 7), "gen": ((7, 9), 300)}
OTHER_SHAPES = {"und": SHAPES["und"], "gen": ((7, 9), 301)}
ORDERS = ([0, 1, 2, 3, 4, 5], [1, 3, 5])  # part index = 2 * layer + (0 for und, 1 for gen)


class Part(nn.Module):
    def __init__(self, lin: tuple[int, int], vec: int):
        super().__init__()
        self.lin = nn.Linear(lin[1], lin[0], bias=False)
        self.vec = nn.Parameter(torch.empty(vec, dtype=torch.bfloat16))
        self.one = nn.Parameter(torch.empty(1, dtype=torch.float16))


class Layer(nn.Module):
    def __init__(self, shapes: dict[str, tuple[tuple[int, int], int]]):
        super().__init__()
        self.und = Part(*shapes["und"])
        self.gen = Part(*shapes["gen"])


def build_model(shapes: dict[str, tuple[tuple[int, int], int]]) -> nn.ModuleList:
    return nn.ModuleList(Layer(shapes) for _ in range(NUM_LAYERS))


def bindings(model: nn.ModuleList) -> list[PartBinding]:
    out = []
    for i, layer in enumerate(model):
        for key in ("und", "gen"):
            part = getattr(layer, key)
            params = (
                (part.lin, "weight", f"layers.{i}.{key}.lin.weight"),
                (part, "vec", f"layers.{i}.{key}.vec"),
                (part, "one", f"layers.{i}.{key}.one"),
            )
            out.append(PartBinding(f"{i}.{key}", params, lane=key))
    return out


def write_checkpoint(folder: Path, shapes: dict[str, tuple[tuple[int, int], int]], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for binding in bindings(build_model(shapes)):
        for module, leaf, name in binding.params:
            ref = getattr(module, leaf)
            tensors[name] = torch.randn(ref.shape, generator=gen).to(ref.dtype)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))


def stage_through_host(engine: LayerOffload) -> None:
    """The path of ranks sharing one GPU (`--device cuda:N`): the real CudaBackend on stand-in streams and
    events, every part gathered by gloo in a host staging buffer, then copied whole into its slot."""
    from cosmos3_batch.engine.cuda_backend import CudaBackend
    from tests.unit.test_cuda_ordering import FakeCuda

    engine.backend.close(1.0)
    engine.source.staged = engine.config.world_size > 1  # as the engine decides it on a GPU (offload.py)
    fake = FakeCuda()
    engine.backend = CudaBackend(engine.source, engine.slots, "cpu", cuda=fake)
    fake.backend = engine.backend


def run_mode(mode: str, folder: Path, shapes: dict, rank: int, world_size: int) -> dict:
    truth = load_file(str(folder / "model.safetensors"))
    with torch.device("meta"):
        model = build_model(shapes)
    binds = bindings(model)
    group = dist.new_group(backend="gloo")  # gathers on their own group, as the runner does
    # As the runner configures it: two GEN slots and one UND slot.
    engine_mode = OffloadMode.ALLGATHER if mode == "staged" else OffloadMode(mode)
    config = OffloadConfig(engine_mode, rank, world_size, lane_slots=(("gen", 2), ("und", 1)))
    engine = LayerOffload(binds, TensorStore(folder), config, torch.device("cpu"), group)
    if mode == "staged":
        stage_through_host(engine)
    passes = []
    try:
        for order in ORDERS:
            # Every pass starts with GEN part 1 (layer 0): prefetched while the pass before ends, as the
            # runner's weights do; the last pass's prefetch is still in flight at close().
            engine.begin_pass(order, prefetch=[1])
            wrong = []
            for index in order:
                engine.acquire(index)
                # Checked before the next acquire: the fetch after that one reuses this part's slot.
                for module, leaf, name in binds[index].params:
                    param = getattr(module, leaf)
                    if not (isinstance(param, nn.Parameter) and torch.equal(param, truth[name])):
                        wrong.append(name)
                lin, _, name = binds[index].params[0]
                x = torch.arange(lin.in_features, dtype=torch.float32).unsqueeze(0)
                # clone(): an allocator-aligned copy, like the slot (a GEMV's rounding depends on alignment).
                if not torch.equal(lin(x), F.linear(x, truth[name].clone())):
                    wrong.append(f"forward {binds[index].key}")
            counters = engine.end_pass()
            passes.append({"order": order, "wrong": wrong, "counters": vars(counters)})
    finally:
        engine.close()
    layouts = [[p.key, p.nbytes, p.shard_bytes, p.payload_bytes] for p in engine.layouts]
    return {"mode": mode, "digest": engine.digest, "layouts": layouts, "passes": passes}


@record
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--scenario", choices=["ok", "shape", "world", "world_less"], default="ok")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    odd = rank == 1 and args.scenario != "ok"
    shapes = OTHER_SHAPES if odd and args.scenario == "shape" else SHAPES
    folder = args.ckpt / "rank1" if odd and args.scenario == "shape" else args.ckpt / "shared"
    if rank == 0 or folder.name == "rank1":
        write_checkpoint(folder, shapes, seed=0)
    dist.barrier()  # the checkpoint is complete before anyone opens it
    result: dict = {"rank": rank, "world_size": world_size, "modes": [], "error": None}
    modes = ["allgather", "sharded", "local", "staged"] if args.scenario == "ok" else ["allgather"]
    config_world = world_size + {"world": 1, "world_less": -1}.get(args.scenario, 0) if odd else world_size
    try:
        for mode in modes:
            result["modes"].append(run_mode(mode, folder, shapes, rank, config_world))
    except Exception as exc:
        result["error"] = {"type": type(exc).__name__, "message": str(exc)}
        print(f"rank {rank}: {type(exc).__name__}: {exc}", flush=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(result))
    if args.scenario != "ok":
        dist.barrier()  # every rank has written its verdict before torchrun stops the others on a failure
    dist.destroy_process_group()
    if result["error"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
