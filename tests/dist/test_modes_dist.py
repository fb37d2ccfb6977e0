"""The generation modes (V2V, system prompt, sound, actions) under real `torchrun` jobs (gloo, CPU): world
2 with allgather and world 3 with local offload reproduce `Cosmos3OmniPipeline.__call__` bit for bit, the
reference run in this process at the single thread torchrun gives each worker."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cosmos3_batch.requests.parse import load_requests
from tests.conftest import write_jsonl
from tests.dist.jobs import torchrun_jobs
from tests.dist.test_runs import assert_lockstep
from tests.unit.test_fidelity_modes import CLIP, run_reference

pytestmark = pytest.mark.dist
TINY = {"size": "32x32", "num_frames": 5, "num_inference_steps": 2}
ROWS = [
    {"id": "v2v-first", "prompt": "the clip goes on", **TINY, "video": str(CLIP), "seed": 1},
    {
        "id": "v2v-last",
        "prompt": "the clip goes on",
        **TINY,
        "video": str(CLIP),
        "condition_frames": [1],
        "condition_video_keep": "last",
        "guidance_scale": 1.0,
        "seed": 2,
    },
    {"id": "sys-off", "prompt": "a red cube", **TINY, "system_prompt": False, "seed": 3},
    {"id": "t2v-sound", "prompt": "rain on a roof", **TINY, "sound": True, "seed": 4},
    {"id": "i2v-sound", "prompt": "it hums", **TINY, "image": "IMAGE", "sound": True, "guidance_scale": 1.0},
    {"id": "policy", "prompt": "grab it", "image": "IMAGE", "num_inference_steps": 2, "sound": True,
     "action": {"mode": "policy", "chunk_size": 4, "domain": "fractal", "resolution_tier": 256}},
    {"id": "inverse", "prompt": "what moved", "video": str(CLIP), "num_inference_steps": 2, "seed": 6,
     "action": {"mode": "inverse_dynamics", "chunk_size": 4, "domain": "hand_pose", "resolution_tier": 256}},
    {"id": "forward", "prompt": "push", "image": "IMAGE", "num_inference_steps": 2,
     "action": {"mode": "forward_dynamics", "chunk_size": 4, "domain": "pusht", "resolution_tier": 256,
                "actions": [[0.5, -0.5], [0.25, 0.0]]}},
]  # fmt: skip


@pytest.fixture(scope="module")
def job(tmp_path_factory, tiny_av_ckpt, cond_image) -> tuple[Path, dict]:
    rows = [{**row, "image": str(cond_image)} if "image" in row else row for row in ROWS]
    prompts = write_jsonl(tmp_path_factory.mktemp("modes") / "modes.jsonl", rows)
    requests, _ = load_requests(str(prompts))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # what torchrun's OMP_NUM_THREADS=1 gives each rank
    try:
        reference = run_reference(tiny_av_ckpt, requests, output_types=("latent",))
    finally:
        torch.set_num_threads(threads)
    return prompts, {rid: outs[0] for rid, outs in reference.items()}


# world -> its configurations (offload, --max-active, --sp), run in one launch (tests/dist/jobs.py).
CONFIGS = {
    # --sp 2: sound/action rows split too, and their VAE encodes and decodes shared by the group (the
    # action canvases are 256 pixels wide: split in two; 32x32 outputs are too small and decode whole).
    2: [("allgather", 3, 1), ("allgather", 3, 2)],
    3: [("local", 1, 1)],
}


@pytest.mark.parametrize("world_size", sorted(CONFIGS))
def test_modes_under_torchrun_are_bit_exact(job, tmp_path, tiny_av_ckpt, world_size):
    prompts, reference = job
    jobs = []
    for mode, max_active, sp in CONFIGS[world_size]:
        out = tmp_path / f"{mode}-{max_active}-{sp}"
        jobs.append(["run", prompts, "--model", tiny_av_ckpt, "--out", out, "--offload", mode, "--sp", sp])
        jobs[-1] += ["--save-latents", "--max-active", max_active, "--no-progress"]
        jobs[-1] += ["--vae-patch-parallel-size", sp]
    codes = torchrun_jobs(world_size, jobs, tmp_path / "launch")
    for (mode, max_active, sp), code in zip(CONFIGS[world_size], codes, strict=True):
        assert code == 0, (mode, sp, (tmp_path / "launch" / "stderr.txt").read_text()[-3000:])
        out = tmp_path / f"{mode}-{max_active}-{sp}"
        for rid, expected in reference.items():
            saved = load_file(out / f"{rid}.latents.safetensors")
            assert torch.equal(saved["latents"], expected.video), rid
            if expected.sound is None:
                assert "sound" not in saved, rid
            else:
                assert torch.equal(saved["sound"], expected.sound), rid
            if getattr(expected, "action", None) is not None:
                actions = load_file(out / f"{rid}.actions.safetensors")["actions"]
                assert torch.equal(actions, expected.action[0]), rid
        summary = json.loads((out / "summary.json").read_text())
        assert summary["generated_ok"] == len(ROWS)
        assert_lockstep(summary, world_size)
        if sp == 2:  # the three action requests' canvases (256 wide) are encoded by the group: split where
            # this CPU measures a GEMM step (one thread, as the workers), whole where it measures none
            split = 3 if measured_step() else 0
            assert [r["vae_split_encodes"] for r in summary["ranks"]] == [split, split]
            assert len({r["vae_split_decodes"] for r in summary["ranks"]}) == 1


def measured_step() -> int:
    """The GEMM step the workers measure (vae_exact.gemm_column_step at one thread)."""
    from cosmos3_batch.model.vae_exact import gemm_column_step

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return gemm_column_step(torch.float32)
    finally:
        torch.set_num_threads(threads)
