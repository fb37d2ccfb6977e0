"""Ranks sharing one GPU (`--device cuda:N`): the flag's checks, and the staged AllGather's ordering on CPU.

NCCL refuses two ranks on one device, so such ranks talk through gloo, which has no in-place AllGather of
CUDA tensors: each part is gathered in host memory on the staging thread and crosses to the device whole.
The real `CudaBackend` runs on the stand-in streams and events of test_cuda_ordering; only the host gather
is replaced by one that logs and writes each part's true bytes (tests/dist/test_engine_toy.py runs the
real gloo gather through this path at world sizes 1-4, bytes and counters exact).
"""

from __future__ import annotations

import pytest
import torch

from cosmos3_batch.config import ConfigError, make_config
from cosmos3_batch.engine import cuda_backend
from cosmos3_batch.engine.transport import fetch_bytes
from tests.unit.test_cuda_ordering import GEN_PASS, UND_PASS, FakeCuda, make_engine, run_pass


def config(**flags):
    return make_config("allgather", None, prompts="p.jsonl", out="out", **flags)


def test_cuda_n_is_a_device_and_refuses_what_gloo_cannot_carry():
    assert config(device="cuda:0").device == "cuda:0"
    for bad in ("cuda:", "cuda:x", "gpu", "cuda:-1"):
        with pytest.raises(ConfigError, match="--device must be one of auto, cpu, cuda or cuda:N"):
            config(device=bad)
    with pytest.raises(ConfigError, match="runs neither --sp nor sharded"):
        config(device="cuda:0", sp=2)
    with pytest.raises(ConfigError, match="runs neither --sp nor sharded"):
        make_config("sharded", None, prompts="p.jsonl", out="out", device="cuda:1")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without CUDA gives")
def test_cuda_n_without_a_gpu_says_so():
    from cosmos3_batch.parallel.world import pick_device

    with pytest.raises(ValueError, match="--device cuda:0: no CUDA device is visible"):
        pick_device("cuda:0", local_rank=1)


def staged_engine(tmp_path, monkeypatch):
    engine, _ = make_engine(tmp_path, monkeypatch, world=2)
    engine.backend.close(1.0)
    engine.source.staged = True
    fake = FakeCuda()  # fresh streams for the staged backend
    truth = {
        i: torch.randint(0, 256, (layout.nbytes,), dtype=torch.uint8)
        for i, layout in enumerate(engine.layouts)
    }

    def host_gather(src, index, out):
        assert out.device.type == "cpu"  # the staging buffer, in host memory
        fake.log.append(("host_gather", index))
        out[: src.layouts[index].nbytes].copy_(truth[index])

    monkeypatch.setattr(cuda_backend, "host_gather", host_gather)
    engine.backend = cuda_backend.CudaBackend(engine.source, engine.slots, "cpu", cuda=fake)
    fake.backend = engine.backend
    return engine, fake, truth


def test_a_staged_part_is_gathered_on_the_host_then_copied_whole_after_its_slot_is_free(
    tmp_path, monkeypatch
):
    (tmp_path / "streams").mkdir()
    reference, fake_ref = make_engine(tmp_path / "streams", monkeypatch, world=2)
    run_pass(reference, fake_ref, UND_PASS)
    engine, fake, truth = staged_engine(tmp_path, monkeypatch)
    backend = engine.backend
    engine.begin_pass(UND_PASS, prefetch=(1,))
    for index in UND_PASS:
        engine.acquire(index)
        size = truth[index].numel()
        assert any(torch.equal(slot[:size], truth[index]) for slot in engine.slots), (
            f"part {index} not in a slot"
        )
        fake.log.append(("compute", index))
    engine.end_pass()
    log = list(fake.log)  # the pass (close() fences every stream)
    engine.close()
    for index in UND_PASS:
        gathered = log.index(("host_gather", index))
        ready = next(
            i
            for i in range(gathered, len(log))
            if log[i][:2] == ("record", "copy") and log[i][2] in backend.ready
        )
        freed = [
            i
            for i in range(gathered, ready)
            if log[i][:2] == ("wait", "copy") and log[i][2] in backend.slot_free
        ]
        used = next(i for i in range(ready, len(log)) if log[i] == ("wait", "compute", log[ready][2]))
        assert freed and used < log.index(("compute", index))
    # No comm-stream work: the gathers ran on the host thread, in the order the stream path issues them
    # (the same on every rank: set by the calls alone).
    assert not [e for e in log if e[:2] in (("wait", "comm"), ("record", "comm"))]
    # (After close: the next pass's prefetch may still have been gathering when the pass ended.)
    assert [e[1] for e in fake.log if e[0] == "host_gather"] == [
        e[2] for e in fake_ref.log if e[0] == "gather"
    ]
    # The host only ever waits for a staging buffer's previous H2D, never for the device as a whole.
    assert all(e[1] in backend._staged for e in log if e[0] == "host_wait")


def test_a_staged_fetch_counts_the_whole_part_across_the_host_link(tmp_path, monkeypatch):
    engine, fake, _ = staged_engine(tmp_path, monkeypatch)
    counters = run_pass(engine, fake, GEN_PASS)
    engine.close()
    expected = [fetch_bytes(engine.source, i) for i in GEN_PASS]
    assert all(h2d == engine.layouts[i].nbytes for i, (h2d, _) in zip(GEN_PASS, expected, strict=True))
    assert counters.h2d_bytes == sum(h2d for h2d, _ in expected)
    assert counters.gathered_bytes == sum(
        engine.layouts[i].nbytes - engine.layouts[i].shard_bytes for i in GEN_PASS
    )
    assert counters.collective_s > 0 and counters.fetches == len(GEN_PASS)
