"""plan/schedule.py: deterministic, balanced, pure."""

from __future__ import annotations

import subprocess

import pytest

from cosmos3_batch.plan.schedule import (
    action_tokens,
    assign,
    gen_tokens,
    in_shard,
    parse_shard,
    predicted_cost,
    sound_tokens,
    vision_tokens,
)
from cosmos3_batch.requests.parse import parse_lines
from tests.dist.jobs import JOB_PYTHON


def requests(*rows: str):
    parsed, errors = parse_lines([row.encode() for row in rows])
    assert errors == []
    return parsed


def test_cost_counts_tokens_steps_and_branches():
    img, vid, nocfg = requests(
        '{"prompt": "a", "num_frames": 1, "size": "64x64", "num_inference_steps": 10}',
        '{"prompt": "b", "num_frames": 9, "size": "64x32", "num_inference_steps": 5}',
        '{"prompt": "c", "num_frames": 9, "size": "64x32", "num_inference_steps": 5, "guidance_scale": 1.0}',
    )
    assert vision_tokens(img) == 1 * 2 * 2 and vision_tokens(vid) == 3 * 1 * 2
    assert predicted_cost(img) == 4 * 10 * 2
    assert predicted_cost(vid) == 6 * 5 * 2 and predicted_cost(nocfg) == 6 * 5 * 1


def test_cost_counts_sound_and_action_tokens(tmp_path):
    from PIL import Image

    Image.new("RGB", (64, 48)).save(tmp_path / "f.png")
    rows = [
        '{"prompt": "b", "num_frames": 9, "size": "64x32", "num_inference_steps": 5, "sound": true}',
        '{"prompt": "p", "image": "f.png", "num_inference_steps": 5, '
        '"action": {"mode": "policy", "chunk_size": 8, "domain": "fractal", "resolution_tier": 256}}',
    ]
    parsed, errors = parse_lines([row.encode() for row in rows], base_dir=str(tmp_path))
    assert errors == []
    sound, policy = parsed
    # 9 frames at 24 fps = 18,000 samples at 48 kHz = 10 sound latents (hop 1920), after 6 vision tokens.
    assert sound_tokens(sound) == 10 and gen_tokens(sound) == 6 + 10
    assert predicted_cost(sound) == 16 * 5 * 2
    # Policy, tier 256, a 4:3 frame: the 256x320 canvas (8x10 patches of 32 px) x 3 latent frames + 8 actions.
    assert (policy.height, policy.width) == (256, 320)
    assert action_tokens(policy) == 8 and gen_tokens(policy) == vision_tokens(policy) + 8 == 3 * 8 * 10 + 8


def test_assignment_is_balanced_deterministic_and_complete():
    rows = [
        f'{{"id": "r{i}", "prompt": "x", "num_frames": {1 + 4 * (i % 4)}, "size": "64x64"}}'
        for i in range(10)
    ]
    reqs = requests(*rows)
    a, b = assign(reqs, 3), assign(list(reqs), 3)
    assert a == b
    ids = [r.id for q in a.queues for r in q]
    assert sorted(ids) == sorted(r.id for r in reqs) and len(ids) == len(set(ids))
    # Longest-first greedy is within 4/3 of optimal; with these costs it is within one request of even.
    assert max(a.costs) - min(a.costs) <= max(predicted_cost(r) for r in reqs)
    for queue in a.queues:  # most steps first inside each rank, file order among equals
        keys = [(-r.num_inference_steps, r.line) for r in queue]
        assert keys == sorted(keys)


def test_ranks_get_balanced_compute_and_slot_passes():
    # One 720p video carries as much compute as 43 small images: balancing compute alone puts the video
    # on one rank and every image on the other, whose slots then need 43x the passes.
    big = '{{"id": "v{}", "prompt": "x", "size": "1280x720", "num_frames": 9, "num_inference_steps": 40}}'
    small = '{{"id": "i{}", "prompt": "x", "size": "256x256", "num_frames": 1, "num_inference_steps": 40}}'
    reqs = requests(big.format(0), *[small.format(i) for i in range(43)])
    a = assign(reqs, 2)
    counts = sorted(len(q) for q in a.queues)
    steps = sorted(sum(r.num_inference_steps for r in q) for q in a.queues)
    # The worse of the two shares is minimized: 15 / 29 requests (compute alone: 1 / 43), at a predicted
    # compute idle share under a quarter.
    assert (counts, steps) == ([15, 29], [600, 1160])
    assert a.idle_share < 0.25


def test_more_ranks_than_requests_and_empty():
    reqs = requests('{"prompt": "x", "num_frames": 1, "size": "32x32"}')
    a = assign(reqs, 4)
    assert [len(q) for q in a.queues] == [1, 0, 0, 0]
    assert a.idle_share == 0.75
    assert assign([], 2).queues == ((), ())


def test_schedule_imports_no_torch():
    code = "import cosmos3_batch.plan.schedule, sys; assert 'torch' not in sys.modules"
    subprocess.run([JOB_PYTHON, "-c", code], check=True)


def test_shards_partition_the_file_and_are_stable():
    ids = [f"id{i}" for i in range(200)]
    shards = [[i for i in ids if in_shard(i, k, 3)] for k in range(3)]
    assert sorted(i for shard in shards for i in shard) == sorted(ids)
    assert all(40 < len(s) < 95 for s in shards)  # a hash split: roughly even
    # Dropping other ids never moves an id to another shard (array tasks can be resubmitted).
    assert [i for i in ids[::2] if in_shard(i, 1, 3)] == [i for i in shards[1] if i in ids[::2]]
    assert parse_shard("2/5") == (2, 5)
    for bad in ("5/5", "-1/2", "1", "a/b", "1/0"):
        with pytest.raises(ValueError, match="--shard"):
            parse_shard(bad)
