"""Forward dynamics, inverse dynamics and policy against `Cosmos3OmniPipeline.__call__(action=...)`:
latents and predicted actions bit-exact in float32 on CPU, in one job, whatever `--max-active`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cosmos3_batch.requests import Request, load_requests
from tests.conftest import write_jsonl
from tests.unit.test_fidelity import run_ours
from tests.unit.test_fidelity_modes import CLIP, run_reference

STEPS = {"num_inference_steps": 2}
FD_ROWS = [[0.1 * i - 0.3 * j for j in range(10)] for i in range(3)]  # 3 rows < chunk 4: the last repeats
CASES = [
    {
        "id": "fd-image",
        "prompt": "the arm pushes the cube",
        "image": "IMAGE",
        "action": {"mode": "forward_dynamics", "chunk_size": 4, "domain": "fractal", "resolution_tier": 256,
                   "actions": FD_ROWS},
        **STEPS,
        "seed": 31,
    },
    {
        "id": "fd-npy-video",
        "prompt": "the car drives on",
        "video": "CLIP",
        "action": {"mode": "forward_dynamics", "chunk_size": 4, "domain": "av", "resolution_tier": 256,
                   "actions": "AV_NPY", "viewpoint": "third_person_view"},
        "guidance_scale": 1.0,
        **STEPS,
        "seed": 32,
    },
    {
        "id": "inverse",
        "prompt": "what moved",
        "video": "CLIP",
        "action": {"mode": "inverse_dynamics", "chunk_size": 8, "domain": "bridge_orig_lerobot",
                   "resolution_tier": 256},
        **STEPS,
        "seed": 33,
    },
    {
        "id": "policy-fractal",
        "prompt": "pick up the cup",
        "image": "IMAGE",
        "action": {"mode": "policy", "chunk_size": 4, "domain": "fractal", "resolution_tier": 256},
        **STEPS,
        "seed": 34,
    },
    {
        "id": "policy-hands",
        "prompt": "wave both hands",
        "image": "IMAGE",
        "action": {"mode": "policy", "chunk_size": 4, "domain": "hand_pose", "resolution_tier": 256,
                   "viewpoint": "wrist_view"},
        "guidance_scale": 1.0,
        **STEPS,
        "seed": 35,
    },
]  # fmt: skip


def fill(value, paths: dict):
    if isinstance(value, dict):
        return {k: fill(v, paths) for k, v in value.items()}
    return paths.get(value, value) if isinstance(value, str) else value


@pytest.fixture(scope="module")
def requests_(tmp_path_factory, cond_image) -> list[Request]:
    folder = tmp_path_factory.mktemp("act")
    av = folder / "av.npy"
    np.save(av, np.linspace(-1, 1, 5 * 9, dtype=np.float32).reshape(5, 9))  # 5 rows > chunk 4: truncated
    paths = {"IMAGE": str(cond_image), "CLIP": str(CLIP), "AV_NPY": str(av)}
    rows = [fill(c, paths) for c in CASES]
    requests, errors = load_requests(str(write_jsonl(folder / "p.jsonl", rows)))
    assert errors == []
    return requests


@pytest.fixture(scope="module")
def reference(tiny_av_ckpt, requests_):
    return run_reference(tiny_av_ckpt, requests_)


@pytest.mark.parametrize("max_active", [1, 3])
def test_actions_bit_exact_with_reference_pipeline(tiny_av_ckpt, requests_, reference, max_active):
    ours, _ = run_ours(tiny_av_ckpt, requests_, max_active)
    for rid, (latent_out, np_out) in reference.items():
        assert torch.equal(ours[rid].latents, latent_out.video), rid
        assert np.array_equal(ours[rid].frames, np_out.video), rid
        if latent_out.action is None:
            assert rid.startswith("fd-") and ours[rid].actions is None, rid
            continue
        expected = latent_out.action[0]
        assert ours[rid].actions.dtype == torch.float32, rid
        assert torch.equal(ours[rid].actions, expected), rid


def test_action_outputs_have_the_domains_width(reference):
    assert reference["inverse"][0].action[0].shape == (8, 10)
    assert reference["policy-fractal"][0].action[0].shape == (4, 10)
    assert reference["policy-hands"][0].action[0].shape == (4, 57)
    assert reference["policy-fractal"][0].action[0].abs().max() > 0
