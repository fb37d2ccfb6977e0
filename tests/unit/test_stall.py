"""A peer that stalled or died: the survivors tell it from their own crash, say where the job was, meet in
the job's store to name the ranks that did not come, and one of them speaks (parallel/stall.py)."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from cosmos3_batch.engine.transport import CollectiveFailed, collective_call
from cosmos3_batch.parallel.stall import DIED, STALLED, Place, peer_failure, post_mortem
from cosmos3_batch.parallel.vae_group import PeerLost
from tests.dist.jobs import free_port

GLOO_TIMEOUT = "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation"


def test_a_collective_that_waited_out_its_timeout_is_a_stall_a_quick_failure_a_death():
    # By what failed and how long it waited, never by the words of a message (issue 43).
    timeout = RuntimeError(GLOO_TIMEOUT)
    assert peer_failure(CollectiveFailed("the per-pass exchange", timeout, 29.5), timeout_s=30) == STALLED
    closed = RuntimeError("[pair.cc:534] Connection closed by peer [127.0.0.1]:4242")
    assert peer_failure(CollectiveFailed("the per-pass exchange", closed, 0.2), timeout_s=30) == DIED
    wrapped = RuntimeError("a group VAE walk broke midway, a message failed")
    wrapped.__cause__ = PeerLost("a VAE group message", closed, 0.1)
    assert peer_failure(wrapped, timeout_s=30) == DIED


def test_a_local_error_is_our_own_crash_whatever_its_text_says():
    for text in (GLOO_TIMEOUT, "timed out reading the config", "Connection closed by peer", "aborted"):
        assert peer_failure(RuntimeError(text)) is None
        assert peer_failure(ValueError(text)) is None
    assert peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None


def test_only_a_call_into_torch_distributed_becomes_a_collective_failure():
    with pytest.raises(CollectiveFailed) as raised, collective_call("the per-pass exchange"):
        raise RuntimeError("Connection closed by peer")
    assert raised.value.what == "the per-pass exchange" and raised.value.waited_s >= 0
    with pytest.raises(ValueError), collective_call("the per-pass exchange"):
        raise ValueError("not a collective's error type")


def test_a_backend_error_is_a_peer_by_its_type_wherever_the_host_met_it():
    # NCCL's watchdog and an aborted communicator reach a host read of a stream (a `.tolist()`, a decode's
    # `.cpu()`) as DistBackendError: a peer that never came (exit 69), never this rank's own compute.
    assert peer_failure(dist.DistBackendError("Watchdog caught collective operation timeout")) == STALLED
    assert peer_failure(dist.DistBackendError("NCCL communicator was aborted on rank 1")) == STALLED
    assert peer_failure(dist.DistNetworkError("failed to recv, got 0 bytes")) == DIED
    place = Place(timeout_s=30)
    place.enter("passes", 30, "--collective-timeout-s")
    place.note("all_reduce:12")
    place.event = "read:the step cache's distances"  # PassSync.host_read: a place, no trace entry
    assert place.describe() == "pass 0, a host read of the device (the step cache's distances)"


def test_the_place_names_the_pass_and_the_collective_from_the_trace_events():
    place = Place(timeout_s=30)
    assert place.describe() == "start-up"
    place.enter("loading", 3600, "--load-timeout-s")
    assert (place.describe(), place.timeout_flag) == ("loading", "--load-timeout-s")
    place.enter("passes", 30, "--collective-timeout-s")
    for event in ("all_reduce:12", "part:0.und", "part:0.gen", "all_reduce:12"):
        place.note(event)
    assert place.describe() == "pass 1, the per-pass exchange"
    place.note("part:3.und")
    assert place.describe() == "pass 1, the gather of layer 3's UND part (a prefill pass)"
    place.note("part:3.gen")
    assert place.describe() == "pass 1, the gather of layer 3's GEN part"
    place.note("all_to_all:4,4:0")
    assert place.describe() == "pass 1, an --sp all-to-all"
    place.vae = True
    assert place.describe() == "pass 1, a VAE group exchange"


@pytest.fixture
def store(monkeypatch):
    port = free_port()
    host = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    return host


@pytest.mark.parametrize("seen", [(STALLED, STALLED), (STALLED, DIED), (DIED, STALLED)])
def test_survivors_name_the_rank_that_never_came_and_exactly_one_of_them_speaks(store, seen):
    """World of 3: rank 1 stalled; ranks 0 and 2 meet. Both name rank 1, one line is said; a survivor whose
    collective broke because the other had already left (it saw a death) still says the stall."""
    place = Place(stage="passes", timeout_s=5)
    place.note("all_reduce:12")
    verdicts = {}
    kinds = dict(zip((0, 2), seen, strict=True))

    def survivor(rank: int) -> None:
        verdicts[rank] = post_mortem(rank, 3, kinds[rank], place, bound_s=1.0)

    threads = [threading.Thread(target=survivor, args=(rank,)) for rank in (0, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert {rank: v.missing for rank, v in verdicts.items()} == {0: [1], 2: [1]}
    assert sorted(v.speaker for v in verdicts.values()) == [False, True]
    expected = (
        "rank 1 did not arrive within --collective-timeout-s 5 at pass 0, the per-pass exchange (stalled: "
        "a hung GPU, a frozen filesystem?); finished outputs are written. Requeue the job: a rerun "
        "generates exactly the rest (exit 69)"
    )
    assert verdicts[0].line == verdicts[2].line == expected


def test_a_dead_peer_and_an_unreachable_store_are_said_too(store, monkeypatch):
    place = Place(stage="passes", timeout_s=5)
    place.note("part:2.gen")
    died = post_mortem(1, 2, DIED, place, bound_s=0.5)
    assert died.missing == [0] and died.speaker
    assert died.line.startswith("rank 0 left the job at pass 0, the gather of layer 2's GEN part (its")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))  # nobody listens: the store's host is the stuck one
    lost = post_mortem(1, 2, STALLED, place, bound_s=0.5)
    assert lost.missing is None and lost.speaker and "which one is unknown" in lost.line


def test_a_stop_signal_ends_the_meeting_where_a_dead_rank_would_keep_it_waiting(store):
    """torchrun's agent SIGTERMs the survivors once a rank has died, and SIGKILLs them 30 s later: the
    meeting, which the dead rank never joins, must hear the signal (checked between slices of the store's
    wait) rather than wait out its bound. Here the stop comes before the third slice of an hour's bound."""
    place = Place(stage="passes", timeout_s=3600)
    place.note("all_reduce:12")
    looks = []

    def stopping() -> bool:
        looks.append(True)
        return len(looks) == 3

    verdict = post_mortem(1, 2, DIED, place, bound_s=3600, stopping=stopping)
    assert len(looks) == 3 and verdict.missing == [0] and verdict.speaker
    assert verdict.line.startswith("rank 0 left the job at pass 0, the per-pass exchange")


def test_what_a_call_raises_of_this_ranks_own_device_stays_its_own():
    # Out of memory in an all_gather_object's device copy is this rank's crash (exit 1), not a peer's.
    with pytest.raises(torch.OutOfMemoryError), collective_call("an exchange of the ranks' records"):
        raise torch.OutOfMemoryError("CUDA out of memory")
    assert peer_failure(torch.OutOfMemoryError("CUDA out of memory"), timeout_s=30) is None
    # A store that lost a peer while groups were made; an NCCL error a call wrapped: by their types.
    assert peer_failure(dist.DistStoreError("wait timeout after 30000ms")) == DIED
    backend = dist.DistBackendError("NCCL watchdog")
    wrapped = CollectiveFailed("the gather of part 3", backend, 0.0)  # at once: yet a stall, by its type
    wrapped.__cause__ = backend
    assert peer_failure(wrapped, timeout_s=30) == STALLED
