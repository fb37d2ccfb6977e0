"""--vae-patch-parallel-size, in one process: the split decode and encode (model/vae_patch.py) run by
threads over in-process gloo process groups with the real transport (parallel/vae_group.py) equal
diffusers' unsplit `AutoencoderKLWan.decode` / `encode` bit for bit on CPU float32; the three rounding
fixes (model/vae_exact.py) each equal the whole call; a group decode's opening broadcast makes bad
latents fail on every member; a walk that breaks midway leaves the team issuing no collective; the flag's
checks exit 2; `plan` shows the decode's time and memory per rank."""

from __future__ import annotations

import copy
import json
import threading
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers import AutoencoderKLWan
from typer.testing import CliRunner

from cosmos3_batch.cli import app
from cosmos3_batch.model import vae_shards
from cosmos3_batch.model.tiny import TinySpec, vae_config
from cosmos3_batch.model.vae_exact import (
    conv_as_in_whole,
    gemm_column_step,
    mean_as_in_whole,
    silu_as_in_whole,
)
from cosmos3_batch.model.vae_patch import Shard, decode_shard, encode_shard
from cosmos3_batch.model.vae_shards import plan_cut, shard_sizes
from cosmos3_batch.parallel.vae_group import GroupBroken, PatchGroup
from cosmos3_batch.pipeline.finish.vae_team import VaeTeam, agree_inputs
from cosmos3_batch.pipeline.kinds.denoise import RequestFailed, RequestJob
from tests.conftest import write_jsonl

pytestmark = (
    pytest.mark.exact
)  # run twice by scripts/test.sh: SiLU's and the GEMM's steps vary by instruction set


@pytest.fixture(scope="module")
def vae():
    torch.manual_seed(0)
    return AutoencoderKLWan(**vae_config(TinySpec(), torch.Generator().manual_seed(0))).eval()


@pytest.fixture(autouse=True)
def one_thread():
    """The cut is used at one intra-op thread (model/vae_shards.py), as under torchrun."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def in_threads(ranks: int, fn, timeout_s: float = 60.0, staged: bool = False) -> list:
    """fn(PatchGroup) on `ranks` threads, each with its rank of one in-process gloo group; the results (an
    exception where fn raised). `staged`: the group's messages through host buffers, as on a GPU."""
    store, groups, out = dist.HashStore(), [None] * ranks, [None] * ranks

    def make(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(store, rank, ranks, timedelta(seconds=timeout_s))

    def work(rank: int) -> None:
        try:
            with torch.no_grad():
                out[rank] = fn(PatchGroup(groups[rank], rank, ranks, ranks, host_staged=staged))
        except Exception as exc:
            out[rank] = exc

    for target in (make, work):
        threads = [threading.Thread(target=target, args=(r,)) for r in range(ranks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return out


def split(
    cut: Shard, x: torch.Tensor, walk, vae, scale: int = 1, staged: bool = False
) -> tuple[torch.Tensor, list[PatchGroup]]:
    groups: list[PatchGroup] = []

    def one(group: PatchGroup):
        groups.append(group)
        exchange = group.bind(cut)
        shard = exchange.shard
        return exchange.collect(walk(vae, shard.of(x, scale), shard, exchange), cut.dim)

    out = in_threads(len(cut.sizes), one, staged=staged)
    for result in out:
        if isinstance(result, Exception):
            raise result
    return out[0], sorted(groups, key=lambda g: g.index)


# (latent frames, latent height, latent width, P): an image cut in two, an odd height over four ranks
# (4+3+3+3), a video cut along its width, a 9 x 6 video whose floor (16 pixels) leaves P = 4 three ranks.
CASES = [
    (1, 8, 8, 2, (4, 4)),
    (2, 13, 7, 4, (4, 3, 3, 3)),
    (3, 4, 16, 4, (4, 4, 4, 4)),
    (2, 9, 6, 4, (3, 3, 3)),
]


def measured_branch(cpu_branch) -> int:
    """This CPU's GEMM step at one thread (the cut's setting), said as the branch the test asserts."""
    step = gemm_column_step(torch.float32)
    if step:
        cpu_branch(f"VAE walk: GEMM step {step} measured at 1 thread -> split; every shard equals the whole")
    else:
        cpu_branch("VAE walk: no GEMM step measured at 1 thread -> not split; one rank decodes the whole")
    return step


@pytest.mark.parametrize(("frames", "height", "width", "parts", "sizes"), CASES)
def test_split_decode_and_encode_equal_diffusers_unsplit_ones(
    vae, frames, height, width, parts, sizes, cpu_branch
):
    """Where this CPU's GEMM step allows a split, the cut is the planned one and its walk equals diffusers'
    unsplit decode and encode; where it does not (step 0), the cut is one shard and the same holds."""
    step = measured_branch(cpu_branch)
    cut = plan_cut((height, width), parts, torch.device("cpu"))
    length, across = (height, width) if height >= width else (width, height)
    if not step:
        assert cut.sizes == (length,)
    elif step <= 4:  # the planned cuts keep the last shard >= 3 columns wide
        assert cut.sizes == sizes
    else:  # a wider step: fewer ranks, the whole's remainder pixels still in the last shard
        last = cut.sizes[-1] * (across if height >= width else 1)
        assert sum(cut.sizes) == length and (len(cut.sizes) == 1 or last >= step - 1)
        assert min(cut.sizes) * across >= vae_shards.MIN_SHARD_PIXELS
    _assert_split_equals_unsplit(vae, cut, frames, height, width)


def test_where_no_step_is_measured_the_decode_is_not_split_and_equals_the_unsplit_one(
    vae, monkeypatch, caplog
):
    """The fallback, asserted on every CPU (a CPU like the issue's AVX2 EPYC at 2 threads measures no step):
    one shard, the unsplit decode's bits, and one log line saying why, however many decodes."""
    monkeypatch.setattr(vae_shards, "gemm_column_step", lambda dtype: 0)
    vae_shards._not_split.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="cosmos3_batch.model.vae_shards"):
            cuts = [plan_cut((8, 8), 2, torch.device("cpu")) for _ in range(3)]
    finally:
        vae_shards._not_split.cache_clear()  # the log-once state stays this test's
    assert [cut.sizes for cut in cuts] == [(8,)] * 3
    assert [r.getMessage().split(": ", 1)[1] for r in caplog.records] == [
        "CPU decodes and encodes are not split, one rank of the group runs each whole (exact, as the "
        "reference): no GEMM step describes this CPU's im2col convolutions (model/vae_exact.gemm_column_step)"
    ]
    cut = cuts[0]
    _assert_split_equals_unsplit(vae, cut, 1, 8, 8)


def _assert_split_equals_unsplit(vae, cut: Shard, frames: int, height: int, width: int) -> None:
    sizes = cut.sizes
    z = torch.randn(1, vae.config.z_dim, frames, height, width, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = vae.decode(z).sample
    decoded, groups = split(cut, z, decode_shard, vae)
    assert torch.equal(decoded, expected)
    if len(sizes) == 2:  # the second shard sends what the first does, plus its frames at the end
        assert groups[1].messages == groups[0].messages + 1
        assert groups[1].sent_bytes - groups[0].sent_bytes == decoded[..., :, sizes[0] * 16 :].numel() * 4
    spatial = vae.config.scale_factor_spatial
    video = torch.rand(1, 3, 4 * (frames - 1) + 1, height * spatial, width * spatial) * 2 - 1
    with torch.no_grad():
        expected = vae.encode(video).latent_dist.parameters
    encoded, _ = split(cut, video, encode_shard, vae, spatial)
    assert torch.equal(encoded, expected)


def test_the_cut_keeps_a_floor_and_one_thread(monkeypatch):
    assert shard_sizes(13, 7, 4) == (4, 3, 3, 3)  # >= 16 latent pixels each
    assert shard_sizes(4, 2, 4) == (4,)  # 8 pixels: one rank
    assert plan_cut((8, 8), 2, torch.device("cpu")).sizes == (4, 4)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # a thread pool cuts the loops SiLU's fix reproduces: not split on CPU
    try:
        assert plan_cut((8, 8), 2, torch.device("cpu")).sizes == (8,)
        assert plan_cut((8, 8), 2, torch.device("meta")).sizes == (4, 4)
    finally:
        torch.set_num_threads(threads)
    # A GEMM whose last m % 4 pixels round apart (MKL's SSE4.2 path): the whole's last pixels of a frame must
    # be the last shard's, so a width cut's last shard keeps >= 3 columns (20 over 8 or 7 leaves it 2).
    monkeypatch.setattr(vae_shards, "gemm_column_step", lambda dtype: 1)
    assert plan_cut((16, 20), 8, torch.device("cpu")).sizes == (3, 3, 3, 3, 2, 2, 2, 2)
    monkeypatch.setattr(vae_shards, "gemm_column_step", lambda dtype: 4)
    assert plan_cut((16, 20), 8, torch.device("cpu")).sizes == (4, 4, 3, 3, 3, 3)
    assert plan_cut((13, 7), 4, torch.device("cpu")).sizes == (4, 3, 3, 3)  # a height cut: rows of 7 pixels
    monkeypatch.setattr(vae_shards, "gemm_column_step", lambda dtype: 0)  # a GEMM no step describes
    assert plan_cut((8, 8), 2, torch.device("cpu")).sizes == (8,)
    monkeypatch.undo()
    # A torch without the private calls the backend fix makes (other than the pinned 2.13): one rank, whole.
    monkeypatch.delattr(torch._C, "_select_conv_backend")
    assert plan_cut((8, 8), 2, torch.device("cpu")).sizes == (8,)


@pytest.mark.parametrize("shape", [(1, 8, 1, 13, 7), (1, 12, 2, 9, 33), (1, 16, 1, 5, 3), (2, 4, 3, 1, 40)])
def test_silu_of_a_shard_rounds_as_the_whole(shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2)) * 4
    whole = F.silu(x)
    for dim in (3, 4):
        extent = shape[dim]
        for start in range(extent):
            for rows in range(1, extent - start + 1):
                part = x.narrow(dim, start, rows).contiguous()
                got = silu_as_in_whole(part, dim, start, extent)
                assert torch.equal(got, whole.narrow(dim, start, rows)), (dim, start, rows)


def test_the_encoder_shortcut_mean_of_a_shard_rounds_as_the_whole():
    x = torch.randn(1, 16, 8, 2, 13, 7, generator=torch.Generator().manual_seed(3))
    whole = x.mean(dim=2)
    for dim in (4, 5):
        extent = x.shape[dim]
        for start in range(extent):
            for rows in range(1, extent - start + 1):
                got = mean_as_in_whole(x.narrow(dim, start, rows).contiguous(), dim, start, extent)
                assert torch.equal(got, whole.narrow(dim - 1, start, rows)), (dim, start, rows)


@pytest.mark.parametrize("channels", [16, 64, 1024])
def test_a_convolution_of_a_shard_uses_the_whole_calls_kernel(channels, cpu_branch):
    """A 3-D convolution whose whole input is past torch's size for oneDNN and whose shards are not (1024
    channels), or below it for all: im2col + GEMM, whose m (9 x 5 output pixels, a shard's rows x 5) leaves
    every remainder a GEMM step of 2, 4 or 8 can; shards of 5 and 10 pixels are padded to the measured
    range (GEMM_PIXELS). Where no step is measured the walk never runs a shard's convolution: the cut is
    one shard (asserted) and the whole call is the decode's."""
    conv = torch.nn.Conv3d(channels, 8, 3).eval()
    x = torch.randn(1, channels, 3, 11, 7, generator=torch.Generator().manual_seed(4))
    if not measured_branch(cpu_branch):
        assert plan_cut((9, 5), 4, torch.device("cpu")).sizes == (9,)
        return
    with torch.no_grad():
        whole = conv(x)
        for start in range(9):
            for rows in range(1, 10 - start):
                part = x.narrow(3, start, rows + 2)
                got = conv_as_in_whole(conv, part, list(x.shape), 3, last=start + rows == 9)
                assert torch.equal(got, whole.narrow(3, start, rows)), (start, rows)


def teams(ranks: int, vae, fn, timeout_s: float = 60.0) -> list:
    def one(group: PatchGroup):
        team = VaeTeam(ranks, vae, encoding=group, decoding=group)
        return team, fn(team)

    return in_threads(ranks, one, timeout_s)


def decoding_job(team: VaeTeam, vae, latents: torch.Tensor) -> RequestJob:
    helper = SimpleNamespace(
        _vae_latents_mean=torch.zeros(vae.config.z_dim),
        _vae_latents_inv_std=torch.ones(vae.config.z_dim),
        video_processor=SimpleNamespace(postprocess_video=lambda video, output_type: video.numpy()),
    )
    job = RequestJob.__new__(RequestJob)
    job.ctx = SimpleNamespace(vae_team=team, helper=helper, vae=vae, vae_lock=threading.Lock())
    job.latents, job.timings, job.branches, job.streams = latents, {}, [], []
    return job


def test_latents_that_are_not_finite_on_the_writer_fail_the_request_on_every_member(vae):
    def decode(team: VaeTeam):
        latents = torch.randn(1, vae.config.z_dim, 1, 8, 8)
        if team.decoding.index == 0:
            latents[0, 0, 0, 0, 0] = float("nan")  # only the writer's: the others decode the writer's
        try:
            decoding_job(team, vae, latents).decode()
        except RequestFailed as exc:
            return str(exc), team.split_decodes, team.decoding.messages
        return None

    results = teams(2, vae, decode)
    assert [r[1][0].startswith("latents contain NaN") for r in results] == [True, True]
    assert [r[1][1:] for r in results] == [(0, 0), (0, 0)]  # nothing was decoded, no halo was sent


def test_a_group_decode_gives_the_writer_the_frames_and_the_others_none(vae):
    z = torch.randn(1, vae.config.z_dim, 2, 8, 8, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = vae.decode(z).sample.float().numpy()[0]
    results = teams(2, vae, lambda team: decoding_job(team, vae, z).decode())
    assert results[1][1] is None
    assert (results[0][1].frames == expected).all()
    assert [team.split_decodes for team, _ in results] == [1, 1]


def test_a_walk_broken_midway_ends_the_team_on_every_member(vae, monkeypatch):
    """The second member fails at its third halo: it stops there, the first one's wait for that halo times
    out; both teams are broken and issue no collective again (the pass loop's check ends the job), each
    saying what broke it: its own compute, or a message of its peer's."""
    from cosmos3_batch.parallel import vae_group

    calls = {"n": 0}
    halo = vae_group._Bound.halo

    def failing(self, x, dim, before, after):
        if self.group.index == 1:
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("out of memory")
        return halo(self, x, dim, before, after)

    monkeypatch.setattr(vae_group._Bound, "halo", failing)
    z = torch.randn(1, vae.config.z_dim, 1, 8, 8)

    def decode(team: VaeTeam):
        with pytest.raises(GroupBroken) as broke:
            team.decode(z)
        sent = team.decoding.messages
        with pytest.raises(GroupBroken):  # at once: no collective
            team.decode(z)
        with pytest.raises(GroupBroken) as again:
            team.check()
        return sent == team.decoding.messages and str(again.value) == str(broke.value), str(broke.value)

    (first, second) = [r[1] for r in teams(2, vae, decode, timeout_s=3)]
    assert first[0] and second[0]
    assert first[1].startswith("a group VAE walk broke midway, a message failed: a peer rank died or stalled")
    assert second[1] == "a group VAE walk broke midway, failed on this rank: RuntimeError: out of memory"


def test_an_unsplit_decode_that_fails_fails_its_request_alone(vae):
    """A latent too small to split (4x4: one shard of 16 pixels) is decoded whole by the writer after the
    cut's one broadcast: its error fails that request (the finisher reports it), not the team, and the next
    decode (split) runs."""
    small = torch.randn(1, vae.config.z_dim, 1, 4, 4, generator=torch.Generator().manual_seed(8))
    z = torch.randn(1, vae.config.z_dim, 1, 8, 8, generator=torch.Generator().manual_seed(9))

    def out_of_memory(latents):
        raise RuntimeError("out of memory")

    def decode(team: VaeTeam):
        if team.decoding.index == 0:  # the writer's VAE: the same modules, a decode that fails
            team.vae = copy.copy(vae)
            object.__setattr__(team.vae, "decode", out_of_memory)
        try:
            first = team.decode(small)
        except RuntimeError as exc:
            first = f"{type(exc).__name__}: {exc}"
        return first, team.broken, team.decode(z) is not None

    results = [r if isinstance(r, Exception) else r[1] for r in teams(2, vae, decode, timeout_s=3)]
    assert results == [("RuntimeError: out of memory", None, True), (None, None, False)]


def test_a_request_one_rank_cannot_read_fails_on_every_rank_before_any_encode():
    class Job:
        needs_encode = True

        def __init__(self, error):
            self.error, self.input_error = error, None

        def load_inputs(self):
            self.input_error = self.error

    jobs = [Job(None), Job("OSError: gone"), Job(None)]
    seq_group = SimpleNamespace(agree=lambda flags: [flags[0], flags[1], False])  # the third: another rank
    agree_inputs(jobs, seq_group)
    assert [j.input_error for j in jobs] == [
        None,
        "OSError: gone",
        "its inputs could not be read on another rank of its --sp group",
    ]


@pytest.mark.parametrize(
    "flags",
    [["--sp", "2", "--vae-patch-parallel-size", "3"], ["--vae-patch-parallel-size", "2"],
     ["--sp", "2", "--vae-patch-parallel-size", "2", "--vae-tiling"]],
)  # fmt: skip
def test_a_group_size_that_does_not_divide_sp_exits_2_before_loading(tmp_path, flags):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x", "size": "32x32", "num_frames": 1}])
    for command in (["run", str(prompts), "--out", str(tmp_path / "out")], ["plan", str(prompts)]):
        result = CliRunner().invoke(app, [*command, *flags])
        assert result.exit_code == 2, result.output
        assert "--vae-patch-parallel-size" in result.output
    assert not (tmp_path / "out").exists()


def test_plan_shows_the_decode_time_and_memory_per_rank(tmp_path, tiny_ckpt):
    import shutil

    from cosmos3_batch.plan.shapes import WAN22_VAE

    root = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, root)
    (root / "vae" / "config.json").write_text(json.dumps(WAN22_VAE))
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x", "size": "832x480", "num_frames": 5}])
    docs = {}
    for parts in (1, 4):
        args = ["plan", str(prompts), "--model", str(root), "--nproc", "4", "--sp", "4"]
        result = CliRunner().invoke(app, [*args, "--vae-patch-parallel-size", str(parts), "--json"])
        assert result.exit_code == 0, result.output
        docs[parts] = json.loads(result.output)["estimate"]
    one, four = docs[1], docs[4]
    assert four["vae_parts"] == 4 and four["decode_s_unsplit"] == one["decode_s"]
    assert four["decode_bytes_unsplit"] == one["device_breakdown"]["vae_decode"]
    # A quarter of the convolutions each (the 30 rows cut 8+8+7+7), the whole-frame attention and the frames
    # gathered on the first rank on top.
    assert one["decode_s"] / 4 < four["decode_s"] < one["decode_s"] / 3
    assert four["device_breakdown"]["vae_decode"] < one["device_breakdown"]["vae_decode"] / 2
    text = CliRunner().invoke(app, [*args, "--vae-patch-parallel-size", "4"]).output
    assert "VAE decode, largest output" in text and "at --vae-patch-parallel-size 4 (one rank:" in text


def test_plan_sizes_a_transfer_chains_decode_by_its_chunk(tmp_path, tiny_ckpt):
    """A Transfer chain decodes chunk by chunk: plan's decode memory and time are one chunk's (93 frames of
    a 189-frame control here), what a 93-frame T2V decode needs, not the whole clip's."""
    import shutil

    import imageio
    import numpy as np

    from cosmos3_batch.plan.shapes import WAN22_VAE

    root = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, root)
    (root / "vae" / "config.json").write_text(json.dumps(WAN22_VAE))
    imageio.mimwrite(tmp_path / "edge.mp4", [np.zeros((16, 16, 3), np.uint8)] * 189, fps=24)
    chain = {
        "id": "c",
        "prompt": "x",
        "size": "832x480",
        "control": {"edge": "edge.mp4"},
        "frames_per_chunk": 93,
    }
    rows = {"chain": chain, "chunk": {"id": "v", "prompt": "x", "size": "832x480", "num_frames": 93}}
    docs = {}
    for name, row in rows.items():
        prompts = write_jsonl(tmp_path / f"{name}.jsonl", [row])
        args = ["plan", str(prompts), "--model", str(root), "--max-vision-tokens", "200000", "--json"]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        docs[name] = json.loads(result.output)
    assert docs["chain"]["transfer"]["chunks"] == 3
    assert docs["chain"]["estimate"]["decode_s"] == docs["chunk"]["estimate"]["decode_s"]
    decode = [docs[name]["estimate"]["device_breakdown"]["vae_decode"] for name in rows]
    assert decode[0] == decode[1] > 0


def test_host_staged_messages_give_the_same_walk_and_counts(vae):
    """On a GPU the decode team's group is gloo with its messages staged through host buffers (issue 48: no
    NCCL from the finisher thread beside the loop's): the same bits and message counts as direct ones."""
    cut = Shard(
        3, (4, 4), 0
    )  # two shards of its height, whatever this CPU's GEMM step (both walks cut alike)
    z = torch.randn(1, vae.config.z_dim, 1, 8, 8, generator=torch.Generator().manual_seed(3))
    direct, direct_groups = split(cut, z, decode_shard, vae)
    staged, staged_groups = split(cut, z, decode_shard, vae, staged=True)
    assert torch.equal(direct, staged)
    assert [g.messages for g in direct_groups] == [g.messages for g in staged_groups] != [0, 0]
    assert [g.sent_bytes for g in direct_groups] == [g.sent_bytes for g in staged_groups]


@pytest.mark.parametrize("staged", [False, True])
def test_the_decode_team_is_warmed_up_without_counting(staged):
    def member(group):
        group.warm_up()
        return group.messages, group.sent_bytes

    assert in_threads(3, member, timeout_s=30, staged=staged) == [(0, 0)] * 3
