"""Where the runner gets each layer part from: resident on the device, or through the DLO engine."""

from __future__ import annotations

from typing import Protocol

import torch

from cosmos3_batch.checkpoint.folder import Checkpoint
from cosmos3_batch.engine.offload import LayerOffload, OffloadConfig, PartBinding
from cosmos3_batch.engine.transport import Counters, OffloadMode, gathers
from cosmos3_batch.model.cosmos3 import GEN, LANE_SLOTS, UND, layer_parts, part_index
from cosmos3_batch.model.dtypes import DtypeRule
from cosmos3_batch.model.fp8 import Fp8Compute
from cosmos3_batch.parallel.stall import phase
from cosmos3_batch.parallel.waiting import WaitMark, peers
from cosmos3_batch.parallel.world import World


class LayerWeights(Protocol):
    """What the runner asks of its layer weights, resident or offloaded."""

    def begin_pass(self, und: bool, gen: bool = True) -> None: ...
    def layer(self, index: int, part: str) -> torch.nn.Module: ...
    def end_pass(self) -> Counters: ...
    def drain(self) -> Counters: ...


class ResidentWeights:
    """All layers live on the device: the baseline every offload mode is compared with."""

    def __init__(self, layers: torch.nn.ModuleList):
        self.layers = layers

    def begin_pass(self, und: bool, gen: bool = True) -> None:
        pass

    def layer(self, index: int, part: str) -> torch.nn.Module:
        return self.layers[index]

    def end_pass(self) -> Counters:
        return Counters()

    def collect(self) -> Counters:
        return Counters()

    def drain(self) -> Counters:
        return Counters()

    def close(self) -> None:
        pass


class OffloadedWeights:
    """Layer parts fetched by the engine, in the same order on every rank: [UND_l, ] [GEN_l] for each l (UND
    on UND passes, GEN on passes with GEN work: runner.py; both decided from the all-reduce's sums).

    UND and GEN parts are separate engine lanes (two GEN slots, one UND slot), so on a UND pass the next
    GEN part is in flight while UND computes (see engine/slots.py). A pass that fetches GEN parts asks for
    the next pass's GEN part 0 as its last prefetch, a guess that the next pass has GEN work too: it is
    fetched while this pass's last layers compute and the runner finishes the pass, exchanges and embeds (on
    every rank alike: the gathers stay in step). A pass without GEN work prefetches none (a reasoner-only
    job moves no GEN byte); one that follows a GEN pass leaves its GEN part 0 in its slot for the next pass
    that has GEN work (the engine counts a part's bytes when it is acquired).
    """

    def __init__(
        self,
        engine: LayerOffload,
        layers: torch.nn.ModuleList,
        mark: WaitMark | None = None,
        und_resident: bool = False,
    ):
        self.engine = engine
        self.layers = layers
        n = len(layers)
        # --und-resident: the UND halves live on the device; the engine holds only the GEN parts, one a layer.
        self.und_resident = und_resident
        index = (lambda i, p: i) if und_resident else part_index
        # The compute thread's wait for a part is a wait for its gather, which needs every rank (on CPU the
        # fetch worker issues it; compute blocks until it is done): marked for rank 0's monitor, with labels
        # made once here, so a layer costs a timestamp. Parts read locally wait for no peer: not marked.
        self.mark = mark if gathers(engine.source) else None
        self._who = peers(engine.config.world_size)
        self._labels = {(i, p): phase(f"part:{i}.{p}") for i in range(n) for p in (UND, GEN)}
        self._index = index
        fetched = {UND: not und_resident, GEN: True}  # --und-resident: the engine holds no UND part
        self._orders = {
            (und, gen): [index(i, p) for i in range(n) for p, wanted in ((UND, und), (GEN, gen))
                         if wanted and fetched[p]]
            for und in (True, False) for gen in (True, False)
        }  # fmt: skip
        self._next_head = [index(0, GEN)] if n else []

    def begin_pass(self, und: bool, gen: bool = True) -> None:
        self.engine.begin_pass(self._orders[und, gen], prefetch=self._next_head if gen else ())

    def layer(self, index: int, part: str) -> torch.nn.Module:
        if part == UND and self.und_resident:
            return self.layers[index]  # its UND tensors are on the device already (place_und)
        if self.mark is None:
            self.engine.acquire(self._index(index, part))
        else:
            with self.mark.waiting(self._labels[index, part], self._who):
                self.engine.acquire(self._index(index, part))
        return self.layers[index]

    def end_pass(self) -> Counters:
        """Once per pass, after its last layer: this pass's bytes and fetches, and (CUDA) the event times
        of every pass whose events have completed, read without a device sync."""
        return self.engine.end_pass()

    def collect(self) -> Counters:
        """Between passes, after a device synchronize (benchmarks): times no end_pass could read yet."""
        return self.engine.collect()

    def drain(self) -> Counters:
        """After the last pass: the device times no end_pass could read yet (their events waited for)."""
        return self.engine.drain()

    def close(self) -> None:
        self.engine.close()


def weights_report(fp8: Fp8Compute | None, calls: bool = False) -> dict:
    """For the sidecar and the summary: the weights' format and the math that ran (FP8: the policy as
    resolved on this device; with `calls`, how many linear calls ran each way, for the rank report)."""
    if fp8 is None:
        return {"format": "checkpoint dtype", "fp8_compute": None}
    report = {"format": "fp8_e4m3", "fp8_compute": fp8.policy_name, "fp8_mode": fp8.mode}
    if calls:
        report.update(w8a16_calls=fp8.w8a16_calls, w8a8_calls=fp8.w8a8_calls)
    return report


def build_weights(
    layers: torch.nn.ModuleList,
    checkpoint: Checkpoint,
    mode: OffloadMode,
    world: World,
    cast: DtypeRule | None = None,
    mark: WaitMark | None = None,
    und_resident: bool = False,
):
    """`cast`: the `--dtype` rule (model/loading.py transformer_rule): the engine casts the shards it reads
    by it, as loading casts resident weights. `mark`: the pass loop's (PassSync.waiting), set around each
    wait for a gathered part. `und_resident` (--und-resident): every UND part is placed on the device here
    and the engine streams the GEN parts only."""
    if mode is OffloadMode.RESIDENT:
        return ResidentWeights(layers)
    parts = layer_parts(layers)
    if und_resident:
        place_und([params for key, params in parts if key.endswith(UND)], checkpoint, cast, world.device)
        parts = [(key, params) for key, params in parts if key.endswith(GEN)]
    bindings = [PartBinding(key, tuple(params), lane=key.rsplit(".", 1)[1]) for key, params in parts]
    lanes = tuple((lane, n) for lane, n in LANE_SLOTS if not (und_resident and lane == UND))
    config = OffloadConfig(
        mode=mode, rank=world.rank, world_size=world.world_size, lane_slots=lanes, cast=cast
    )
    engine = LayerOffload(bindings, checkpoint.store("transformer"), config, world.device, world.gather_group)
    return OffloadedWeights(engine, layers, mark, und_resident)


def place_und(parts: list, checkpoint: Checkpoint, cast: DtypeRule | None, device: torch.device) -> None:
    """Every layer's UND tensors read whole from the checkpoint, cast as the engine casts shards, on the
    device: the layers' own parameters from then on (no slot, no fetch)."""
    store = checkpoint.store("transformer")
    for params in parts:
        for module, leaf, name in params:
            tensor = store.tensor(name)
            dtype = tensor.dtype if cast is None else cast(name, tensor.dtype)
            module._parameters[leaf] = torch.nn.Parameter(
                tensor.to(device=device, dtype=dtype), requires_grad=False
            )
