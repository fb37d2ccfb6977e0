"""The benchmark's peers: other schemes placing the same layers (PyTorch FSDP2, diffusers group
offloading, and a resident control) behind the runner's LayerWeights protocol (passes/weights.py), and
`peer_worker`, one rank that drives the CLI's own planning, schedule and pass loop with a peer placing the
layers."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rank_memory import PeakMemory, peaks_path


def _noop(*args, **kwargs) -> None:
    return None


def load_layers_mmap(transformer, model_dir: Path) -> None:
    """Fill the meta-built layers with zero-copy views of the mmap'd checkpoint: the peers then shard or pin
    from the page cache instead of a private full copy per rank (the careful way to load for them)."""
    import warnings

    from cosmos3_batch.checkpoint.folder import Checkpoint
    from cosmos3_batch.model.loading import fill_module

    store = Checkpoint.open(model_dir).store("transformer")
    views = {}
    for name in store.names():
        if name.startswith("layers."):
            dtype, shape = store.info(name)
            views[name.removeprefix("layers.")] = store.byte_view(name).view(dtype).reshape(shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only mapping: nothing ever writes to it
        fill_module(transformer.layers, views, str(model_dir / "transformer"))


class Fsdp2Weights:
    """FSDP2: every decoder layer is one `fully_shard` unit with `CPUOffloadPolicy`; the root holds the rest.

    FSDP2 unshards in a module's forward pre-hook, but the split forward calls a layer's submodules, never
    the layer. So each layer's `forward` is a no-op and calling the layer fires FSDP2's own pre/post hooks
    (H2D of the shard + AllGather, on FSDP2's streams on CUDA); `reshard_after_forward=False` keeps the
    gathered weights for our compute, and the layer is resharded explicitly when the pass moves on. The
    whole job runs inside one root forward, so FSDP2 sees one forward walking the layers in order, which is
    what its implicit prefetch (CPU issuing the next all-gather while the GPU computes) relies on."""

    def __init__(self, transformer, device):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        from cosmos3_batch.engine.transport import Counters

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        # Pinning needs an accelerator: on CPU the offloaded shards are plain memory.
        policy = CPUOffloadPolicy(pin_memory=device.type == "cuda")
        self.transformer, self.layers = transformer, transformer.layers
        self.bytes = []
        for layer in self.layers:
            layer.forward = _noop
            fully_shard(layer, mesh=mesh, offload_policy=policy, reshard_after_forward=False)
            params = list(layer.parameters())
            own = sum(p.to_local().numel() * p.element_size() for p in params)
            self.bytes.append((own, sum(p.numel() * p.element_size() for p in params) - own))
        fully_shard(transformer, mesh=mesh, offload_policy=policy)
        self.counters, self._current = Counters(), None

    def run(self, runner, queue) -> None:
        self.transformer.forward = lambda: runner.run(queue)
        self.transformer()  # FSDP2's root pre-forward: lazy init, gathers the non-layer weights once

    def begin_pass(self, und: bool, gen: bool = True) -> None:
        self._current = None

    def layer(self, index: int, part: str):
        if index != self._current:  # both halves live in one FSDP unit: one gather serves UND and GEN
            self._release()
            start = time.perf_counter()
            self.layers[index]()  # FSDP2 pre-forward: copy own shard to the device, AllGather, wait
            self.counters.stall_s += time.perf_counter() - start
            own, received = self.bytes[index]  # own shard host->device, the rest from peers (0 at N=1)
            self.counters.h2d_bytes += own
            self.counters.gathered_bytes += received
            self.counters.fetches += 1
            self._current = index
        return self.layers[index]

    def _release(self) -> None:
        if self._current is not None:
            self.layers[self._current].reshard()
            self._current = None

    def drain(self):
        return self.counters.take()  # host clocks, read at each end_pass: nothing left

    def end_pass(self):
        self._release()
        return self.counters.take()


class GroupOffloadWeights:
    """diffusers group offloading, block level, one decoder layer per group, streams where CUDA exists.

    Its hooks wrap `module.forward`; the split forward never calls a layer's forward, so we call each
    layer's group-offloading hook as the wrapped forward would: `pre_forward` (onload; with streams also
    prefetch the next group) before the layer's compute, `post_forward` (offload) after it. With streams,
    diffusers learns the layer order from a first traced forward; we run that trace (no-op layers) up
    front. The non-layer modules (the root group) stay onloaded: the split forward runs embed and head
    outside any root forward, where diffusers would onload and offload them once per step."""

    def __init__(self, transformer, device):
        import torch
        from diffusers.hooks import apply_group_offloading
        from diffusers.hooks.hooks import HookRegistry

        from cosmos3_batch.engine.transport import Counters

        self.layers = transformer.layers
        for layer in self.layers:
            layer.forward = _noop  # only ever called by the trace below
        transformer.forward = lambda: [layer() for layer in self.layers]
        streams = device.type == "cuda"
        apply_group_offloading(
            transformer,
            onload_device=device,
            offload_device=torch.device("cpu"),
            offload_type="block_level",
            num_blocks_per_group=1,
            use_stream=streams,
        )
        if streams:
            transformer()  # diffusers' lazy prefetch records the layer order in the first forward
        self.hooks = [
            HookRegistry.check_if_exists_or_initialize(x).get_hook("group_offloading") for x in self.layers
        ]
        HookRegistry.check_if_exists_or_initialize(transformer).get_hook("group_offloading").group.onload_()
        moves = device.type != "cpu"  # on CPU onload == offload device: the hooks run, nothing moves
        self.bytes = [
            sum(t.numel() * t.element_size() for t in layer.state_dict().values()) * moves
            for layer in self.layers
        ]
        self.counters, self._current = Counters(), None

    def run(self, runner, queue) -> None:
        runner.run(queue)

    def begin_pass(self, und: bool, gen: bool = True) -> None:
        self._current = None

    def layer(self, index: int, part: str):
        if index != self._current:  # the group is the whole layer: one onload serves UND and GEN
            self._release()
            start = time.perf_counter()
            self.hooks[index].pre_forward(self.layers[index])
            self.counters.stall_s += time.perf_counter() - start
            self.counters.h2d_bytes += self.bytes[index]
            self.counters.fetches += 1
            self._current = index
        return self.layers[index]

    def _release(self) -> None:
        if self._current is not None:
            self.hooks[self._current].post_forward(self.layers[self._current], None)
            self._current = None

    def drain(self):
        return self.counters.take()  # host clocks, read at each end_pass: nothing left

    def end_pass(self):
        self._release()
        return self.counters.take()


class DriverControl:
    """The peer driver with the layers simply on the device: tells driver overhead from the peers' cost."""

    def __init__(self, transformer, device):
        from cosmos3_batch.engine.transport import Counters

        self.layers, self._counters = transformer.layers.to(device), Counters

    def run(self, runner, queue) -> None:
        runner.run(queue)

    def begin_pass(self, und: bool, gen: bool = True) -> None:
        pass

    def layer(self, index: int, part: str):
        return self.layers[index]

    def drain(self):
        return self._counters()  # host clocks: nothing to read

    def end_pass(self):
        return self._counters()


PLACERS = {"fsdp2": Fsdp2Weights, "group-offload": GroupOffloadWeights, "control": DriverControl}


def _peer_world(peer: str):
    import torch.distributed as dist

    from cosmos3_batch.parallel.world import init_world

    world = init_world("auto", 600.0)
    if peer == "fsdp2" and not dist.is_initialized():
        # A world of one: our CLI needs no process group, FSDP2 still wants one (torchrun set the env).
        dist.init_process_group("nccl" if world.device.type == "cuda" else "gloo")
    return world


def peer_worker(prefix: str, argv: list[str]) -> int:
    """One rank of a peer: the CLI's planning, schedule and pass loop, with the peer placing the layers."""
    parser = argparse.ArgumentParser(prog="bench/offload_modes.py _peer")
    for flag in ("--peer", "--model", "--prompts", "--out"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--max-active", type=int, default=4)
    parser.add_argument("--und-cache", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args(argv)
    with PeakMemory() as peaks:
        _run_peer(args)
    peaks.write(peaks_path(prefix))
    return 0


def _run_peer(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from cosmos3_batch.config import RunConfig
    from cosmos3_batch.io import outputs
    from cosmos3_batch.pipeline.job.run import plan_run
    from cosmos3_batch.pipeline.kinds.context import load_context
    from cosmos3_batch.pipeline.passes.runner import PassRunner, PassSync
    from cosmos3_batch.plan.schedule import assign

    started = time.time()
    out = Path(args.out)
    cfg = RunConfig(
        prompts=(args.prompts,),
        out=out,
        model=Path(args.model),
        max_active=args.max_active,
        overwrite=True,
        progress=False,
        und_cache=args.und_cache,
    )
    world = _peer_world(args.peer)
    plan = plan_run(cfg)  # the CLI's own validation and tokenization
    mine = assign(plan.requests, world.world_size).queues[world.rank]
    ctx = load_context(plan.model_dir, world.device, with_layers=False, tokenizer=plan.tokenizer)
    load_layers_mmap(ctx.split.transformer, plan.model_dir)
    weights = PLACERS[args.peer](ctx.split.transformer, world.device)
    ok: list[str] = []
    failed: list[str] = []

    def finished(job, result, error) -> None:
        if error is not None:  # counted, like the CLI does; the row then shows fewer outputs
            failed.append(f"{job.request.id}: {error}")
            return
        paths = outputs.paths_for(out, job.request.id, job.request.num_frames)
        outputs.write_latents(paths.latents, result.latents)
        ok.append(job.request.id)

    sync = PassSync(world.world_size, world.exchange_group, rank=world.rank)
    runner = PassRunner(ctx, weights, cfg.max_active, finished, sync, und_cache=cfg.und_cache)
    weights.run(runner, mine)
    ranks = world.all_gather_object({**_rank_report(world.rank, ok, runner), "failed": failed})
    if world.is_main:
        summary = {"wall_s": round(time.time() - started, 3), "generated_ok": sum(r["ok"] for r in ranks)}
        outputs.write_json(out / "summary.json", {**summary, "ranks": ranks})
    world.barrier()
    if dist.is_initialized():
        dist.destroy_process_group()


def _rank_report(rank: int, ok: list[str], runner) -> dict:
    totals = runner.totals
    return {
        "rank": rank,
        "ok": len(ok),
        "passes": runner.passes,
        "pass_s": runner.pass_s,
        "h2d_bytes": totals.h2d_bytes,
        "gathered_bytes": totals.gathered_bytes,
        "stall_s": totals.stall_s,
    }
