"""--vae-patch-parallel-size at admission, in one process: two threads over an in-process gloo group run the
pass loop's own `_admit` with a real team (finish/vae_team.py) and `--sp` group. A request that fails on
one rank before its group encode ends the job on both (else its peer waits in that encode, or pairs it with
the next request's); one that fails after the encode's messages, that needs no encode, or whose unsplit
encode fails, fails alone, on both; an admission with nothing to encode issues no input agreement; the
encodes' broadcasts are in the trace. And the job logs a broken team's own message."""

from __future__ import annotations

import copy
import logging
import threading
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from diffusers import AutoencoderKLWan

from cosmos3_batch.model.tiny import TinySpec, vae_config
from cosmos3_batch.parallel.seq_group import SeqGroup, build_seq_group
from cosmos3_batch.parallel.vae_group import GroupBroken
from cosmos3_batch.pipeline.finish.vae_team import VaeTeam
from cosmos3_batch.pipeline.job.drive import drive
from cosmos3_batch.pipeline.passes import admission as admission_module
from cosmos3_batch.pipeline.passes.admission import Admission
from cosmos3_batch.pipeline.passes.runner import PassRunner
from tests.unit.test_vae_patch import in_threads

IMAGE = torch.rand(1, 3, 1, 128, 128, generator=torch.Generator().manual_seed(6)) * 2 - 1  # latent 8x8: 4+4
SMALL = torch.rand(1, 3, 1, 32, 32, generator=torch.Generator().manual_seed(7)) * 2 - 1  # 2x2: encoded whole


@pytest.fixture(scope="module")
def vae():
    return AutoencoderKLWan(**vae_config(TinySpec(), torch.Generator().manual_seed(0))).eval()


@pytest.fixture(autouse=True)
def one_thread():
    """The cut is used at one intra-op thread (model/vae_shards.py), as under torchrun."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Job:
    """A request at admission: `prepare` encodes `video` (its conditioning) through the team, and fails
    "before" or "after" that encode where `fail` says."""

    def __init__(
        self, rid: str, team: VaeTeam, video: torch.Tensor | None = None, fail: str | None = None, encodes=1
    ):
        self.request = SimpleNamespace(id=rid, transfer=None)
        self.team, self.video, self.fail = team, video, fail
        self.needs_encode = video is not None
        self.group_encodes = encodes if video is not None else 0  # a Transfer request makes several
        self.input_error = None

    def load_inputs(self) -> None:
        pass

    def prepare(self) -> None:
        if self.fail == "before":
            raise RuntimeError("out of memory (preprocessing)")
        for index in range(self.group_encodes):
            if index == 1 and self.fail == "between":
                raise RuntimeError("out of memory (between its encodes)")
            self.team.encode(self.video)
        if self.fail == "after":
            raise RuntimeError("out of memory (after the encode)")


class FailingEncoder:
    """An encode view whose unsplit encode runs out of memory."""

    def _encode(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("out of memory (an unsplit encode)")


def admitting(vae, admissions, monkeypatch, timeout_s: float) -> tuple[list, list[VaeTeam]]:
    """`PassRunner._admit` of each list of jobs `admissions(rank, team)` gives, in turn, on two thread ranks
    (the group's encode team and `--sp` group on one gloo group, as on CPU). Per rank: (the ids admitted by
    each call, the (id, error) failures, the trace's events), or the exception; and the teams."""
    monkeypatch.setattr(admission_module, "job_class", lambda request: lambda ctx, request, **_: request)
    teams: list = [None, None]

    def rank_main(group):
        events, failed = [], []
        group.note = events.append
        own = copy.deepcopy(
            vae
        )  # each rank its own VAE, as each process has: its causal cache is per instance
        teams[group.index] = team = VaeTeam(2, own, encoding=group, encode_vae=own)
        runner = PassRunner.__new__(PassRunner)
        runner.leads = True
        sp = SeqGroup(2, group.index, 0, group.pg, note=events.append, host=group.pg)
        runner.admission = Admission(None, True, sp, 2, None, True, None, team)
        runner.finisher = SimpleNamespace(fail=lambda job, error: failed.append((job.request.id, error)))
        admitted = [[job.request.id for job in runner._admit(jobs)] for jobs in admissions(group.index, team)]
        return admitted, failed, events

    return in_threads(2, rank_main, timeout_s), teams


def test_a_request_failing_on_one_rank_before_its_group_encode_ends_the_job_on_both(vae, monkeypatch):
    def admissions(rank: int, team: VaeTeam) -> list:
        # Two requests of one shape: rank 1 going on to "b" would encode it with rank 0's "a".
        return [[Job("a", team, IMAGE, fail="before" if rank else None), Job("b", team, IMAGE)]]

    (first, second), teams = admitting(vae, admissions, monkeypatch, timeout_s=2)
    assert isinstance(second, GroupBroken), second
    assert str(second) == (
        "request a failed on this rank before its group encodes were done: RuntimeError: out of memory "
        "(preprocessing)"
    )
    assert teams[1].encoding.messages == 0 and teams[1].encodes == 0
    # Rank 0 waited in a's encode until the group's timeout: its peer is gone, not its own walk.
    assert isinstance(first, GroupBroken), first
    assert "a message failed: a peer rank died or stalled past --collective-timeout-s" in str(first)


def test_a_request_failing_between_its_group_encodes_ends_the_job_on_both(vae, monkeypatch):
    """A Transfer request's admission makes one group encode per control and one for its target: an error
    on one rank after the first of them leaves its peer in the next one (not "messages done")."""

    def admissions(rank: int, team: VaeTeam) -> list:
        return [[Job("tr", team, IMAGE, fail="between" if rank else None, encodes=3), Job("b", team, IMAGE)]]

    (first, second), teams = admitting(vae, admissions, monkeypatch, timeout_s=2)
    assert isinstance(second, GroupBroken), second
    assert str(second) == (
        "request tr failed on this rank before its group encodes were done: RuntimeError: out of memory "
        "(between its encodes)"
    )
    assert teams[1].encodes == 1
    assert isinstance(first, GroupBroken), first
    assert "a message failed: a peer rank died or stalled past --collective-timeout-s" in str(first)


def test_what_fails_after_the_groups_messages_fails_alone_on_both_ranks(vae, monkeypatch):
    def admissions(rank: int, team: VaeTeam) -> list:
        if rank:
            team.encode_vae = FailingEncoder()
        return [
            [Job("t1", team), Job("t2", team, fail="before" if rank else None)],  # nothing to encode
            [
                Job("e1", team, IMAGE, fail="after" if rank else None),  # after its split encode
                Job("e2", team, SMALL),  # the unsplit encode fails on rank 1
                Job("e3", team, IMAGE),
            ],
        ]

    results, teams = admitting(vae, admissions, monkeypatch, timeout_s=10)
    latent = f"broadcast:1x{2 * vae.config.z_dim}x1x8x8"  # a split encode's result, from its first rank
    for rank, result in enumerate(results):
        assert not isinstance(result, Exception), result
        admitted, failed, events = result
        assert admitted == [["t1"], ["e3"]]
        other = "failed to prepare on another rank of its --sp group"
        errors = {
            "t2": "RuntimeError: out of memory (preprocessing)",
            "e1": "RuntimeError: out of memory (after the encode)",
            "e2": "RuntimeError: out of memory (an unsplit encode)",
        }
        assert failed == [(rid, error if rank else other) for rid, error in errors.items()]
        # The first admission: only the prepare agreement (no input agreement). The second: the input
        # agreement, each encode's cut (one broadcast) and the split ones' results, the prepare agreement.
        encodes = ["broadcast:1", latent, "broadcast:1", "broadcast:1", latent]
        assert events == ["agree:2", "agree:3", *encodes, "agree:3"]
        assert teams[rank].broken is None and teams[rank].encodes == 3 and teams[rank].split_encodes == 2


def test_an_sp_group_agrees_on_a_gloo_group_of_its_ranks(monkeypatch):
    """On GPUs the group's communicator is NCCL; its agreements (flags the host reads at once) go to a gloo
    group of the same ranks, made in the same order on every rank, so no read waits for a device stream."""
    made = []

    def new_group(ranks, backend, timeout):
        made.append((ranks, backend))
        return len(made)

    monkeypatch.setattr(dist, "new_group", new_group)
    gpu = build_seq_group(3, 4, 2, torch.device("cuda", 1), 60)
    assert made == [([0, 1], "nccl"), ([0, 1], "gloo"), ([2, 3], "nccl"), ([2, 3], "gloo")]
    assert (gpu.group, gpu.host) == (3, 4)
    made.clear()
    cpu = build_seq_group(3, 4, 2, torch.device("cpu"), 60)
    assert made == [([0, 1], "gloo"), ([2, 3], "gloo")] and cpu.group == cpu.host == 2
    # The flags never go to the device (meta here: a device whose tensors cannot be read at all).
    events = []
    host = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=5))
    group = SeqGroup(1, 0, 0, None, torch.device("meta"), note=events.append, host=host)
    assert group.agree([True, False]) == [True, False] and events == ["agree:2"]


def test_a_broken_team_is_logged_as_what_failed_on_this_rank(tmp_path, caplog):
    broken = GroupBroken("request a failed on this rank before its group encode: RuntimeError: out of memory")

    def run(queue):
        raise broken

    runner = SimpleNamespace(run=run, weights=SimpleNamespace(close=lambda: None), timeline=[])
    writer = SimpleNamespace(finish=lambda: None, metrics=SimpleNamespace(close=lambda: None))
    cfg, world = SimpleNamespace(out=tmp_path, tag=""), SimpleNamespace(distributed=True, rank=0)
    (tmp_path / ".cosmos3_batch").mkdir()  # where the pass timeline goes
    with pytest.raises(GroupBroken), caplog.at_level(logging.ERROR, logger="cosmos3_batch"):
        drive(cfg, world, runner, [], writer, SimpleNamespace(), SimpleNamespace())
    assert [r.getMessage() for r in caplog.records] == [f"the job ends: {broken}"]


class WriteRecorder(VaeTeam):
    """A team that records which counter each thread writes (issue 48: a `+= 0` from the finisher thread
    could lose an increment of the loop thread's)."""

    def __setattr__(self, name, value):
        if name in ("encodes", "split_encodes", "split_boundary_encodes") and hasattr(self, "writes"):
            self.writes.append((name, threading.current_thread().name))
        super().__setattr__(name, value)


@pytest.mark.parametrize("video", [SMALL, IMAGE], ids=["whole", "split"])
def test_each_encode_counter_is_written_by_one_thread_only(vae, video):
    def rank_main(group):
        vae_of_rank = copy.deepcopy(vae)  # a whole encode writes the instance's causal cache: one per rank
        team = WriteRecorder(2, vae_of_rank, encoding=group, decoding=group, encode_vae=vae_of_rank)
        team.encoding = SimpleNamespace(share_int=group.share_int)  # an admission group of its own
        team.writes = []
        threading.current_thread().name = "finisher"
        team._encode_output(team.decoding, vae_of_rank, video, True)  # a chunk boundary's encode
        boundary = list(team.writes)
        return boundary, team.encodes

    out = in_threads(2, rank_main)
    split = video is IMAGE
    for result in out:
        assert not isinstance(result, Exception), result
        boundary, encodes = result
        assert boundary == ([("split_boundary_encodes", "finisher")] if split else [])
        assert encodes == 0
