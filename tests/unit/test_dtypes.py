"""`--dtype` / `--vae-dtype`: each choice equals the diffusers call docs/running.md names, bit for bit on CPU.

A bf16 checkpoint as stored equals `from_pretrained(path, dtype={"transformer": bf16, "vae": V})` (V: the
VAE's stored float32 here), upcast with `--dtype float32` it equals a plain `from_pretrained(path)`; a
float32 checkpoint cast to bf16 equals `from_pretrained(path, dtype=torch.bfloat16)`. Through the engine
(allgather: the host shards are cast as they are read) and resident (loading casts the layers).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import Cosmos3OmniPipeline
from PIL import Image
from safetensors.torch import load_file

from cosmos3_batch.model.tiny import TinySpec, write_tiny
from tests.conftest import write_jsonl
from tests.unit.test_cli import invoke

pytestmark = pytest.mark.exact

CASES = [
    {
        "id": "img",
        "prompt": "a red cube",
        "num_frames": 1,
        "size": "32x32",
        "num_inference_steps": 2,
        "seed": 7,
    },
    {
        "id": "vid",
        "prompt": "a cat walks",
        "negative_prompt": "blurry",
        "num_frames": 9,
        "size": "48x32",
        "num_inference_steps": 2,
        "seed": 1,
    },
]


@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("ckpt-bf16") / "tiny", TinySpec(dtype="bfloat16"))


def reference(ckpt, dtype) -> dict[str, tuple[torch.Tensor, np.ndarray]]:
    pipe = Cosmos3OmniPipeline.from_pretrained(ckpt, **({} if dtype is None else {"dtype": dtype}))
    pipe.set_progress_bar_config(disable=True)
    out = {}
    for case in CASES:
        width, height = map(int, case["size"].split("x"))
        kwargs = dict(
            prompt=case["prompt"],
            negative_prompt=case.get("negative_prompt"),
            num_frames=case["num_frames"],
            width=width,
            height=height,
            num_inference_steps=case["num_inference_steps"],
        )
        latents = pipe(**kwargs, generator=torch.Generator().manual_seed(case["seed"]), output_type="latent")
        image = None
        if case["num_frames"] == 1:  # a video's frames go through H.264: compared through its latents
            image = np.array(pipe(**kwargs, generator=torch.Generator().manual_seed(case["seed"])).video[0])
        out[case["id"]] = (latents.video, image)
    return out


@pytest.fixture(scope="module")
def bf16_reference(bf16_ckpt):
    return reference(bf16_ckpt, {"transformer": torch.bfloat16, "vae": torch.float32})


def ours(ckpt, tmp_path, *flags: str) -> str:
    """Runs into tmp_path/out; what it printed."""
    prompts = write_jsonl(tmp_path / "p.jsonl", CASES)
    out = tmp_path / "out"
    result = invoke("run", prompts, "--out", out, "--model", ckpt, "--device", "cpu", "--no-progress",
                    "--save-latents", *flags)  # fmt: skip
    assert result.exit_code == 0, result.output
    return result.output


def assert_equal(out, expected) -> None:
    for rid, (latents, image) in expected.items():
        got = load_file(out / f"{rid}.latents.safetensors")["latents"]
        assert got.dtype == latents.dtype and torch.equal(got, latents), rid
        if image is not None:
            assert np.array_equal(np.array(Image.open(out / f"{rid}.png")), image), rid


@pytest.mark.parametrize("offload", ["allgather", "resident"])
def test_bf16_checkpoint_as_stored_equals_from_pretrained_in_bf16(
    bf16_ckpt, bf16_reference, tmp_path, offload
):
    ours(bf16_ckpt, tmp_path, "--offload", offload)
    assert_equal(tmp_path / "out", bf16_reference)


def test_bf16_checkpoint_upcast_equals_a_plain_from_pretrained(bf16_ckpt, tmp_path):
    ours(bf16_ckpt, tmp_path, "--dtype", "float32")
    assert_equal(tmp_path / "out", reference(bf16_ckpt, None))


def test_float32_checkpoint_cast_to_bf16_equals_from_pretrained_in_bf16(tiny_ckpt, tmp_path):
    cast = ("--dtype", "bfloat16", "--vae-dtype", "bfloat16")
    ours(tiny_ckpt, tmp_path, *cast)
    assert_equal(tmp_path / "out", reference(tiny_ckpt, torch.bfloat16))
    # The dtypes are part of what resume compares: the same flags skip, the stored dtype makes them again,
    # and naming the stored dtype is the default (the identity outputs were always written with).
    assert "0 generated, 0 failed, 2 already complete" in ours(tiny_ckpt, tmp_path, *cast)
    assert "2 generated" in ours(tiny_ckpt, tmp_path)
    assert "2 already complete" in ours(tiny_ckpt, tmp_path, "--dtype", "float32", "--vae-dtype", "float32")


def test_a_cast_is_refused_where_it_cannot_run(bf16_ckpt, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", CASES[:1])
    result = invoke("run", prompts, "--out", tmp_path / "out", "--model", bf16_ckpt, "--device", "cpu",
                    "--offload", "local", "--dtype", "float32")  # fmt: skip
    assert result.exit_code == 2 and "--offload local streams the checkpoint's stored bytes" in result.output
    result = invoke("run", prompts, "--out", tmp_path / "out", "--dtype", "half")
    assert result.exit_code == 2 and "--dtype must be one of checkpoint, bfloat16, float32" in result.output
