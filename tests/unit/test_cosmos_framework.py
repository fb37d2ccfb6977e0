"""NVIDIA cosmos-framework sample files (DESIGN.md §24): each sample resolves to exactly the request its
equivalent in this tool's own format resolves to, refusals are named, and a run gives the same bytes."""

from __future__ import annotations

import dataclasses
import json
import logging

import imageio
import numpy as np
import pytest
from PIL import Image

from cosmos3_batch.requests.parse import RequestFileError, load_requests
from tests.conftest import assert_same_outputs, moving_square, write_jsonl
from tests.unit.test_cli import invoke, run

NVIDIA = "cosmos-framework"


@pytest.fixture
def media(tmp_path):
    Image.fromarray((np.random.RandomState(0).rand(40, 56, 3) * 255).astype(np.uint8)).save(
        tmp_path / "c.png"
    )
    imageio.mimwrite(tmp_path / "clip.mp4", moving_square(9), fps=8)
    (tmp_path / "acts.json").write_text(json.dumps([[0.1] * 10 for _ in range(4)]))
    return tmp_path


def where_free(requests):
    """The requests with where they came from blanked: what must be equal across the two formats."""
    return [dataclasses.replace(r, line=0, source="", unit="line", sample=None) for r in requests]


def both(tmp_path, sample: dict, ours: dict, name: str = "s"):
    (tmp_path / f"{name}.json").write_text(json.dumps(sample, indent=2))
    theirs = load_requests(tmp_path / f"{name}.json", input_format=NVIDIA)[0]
    mine = load_requests(write_jsonl(tmp_path / f"{name}-ours.jsonl", [ours]))[0]
    return theirs, mine


CASES = {
    "text2image": (
        {"prompt": "a red cube", "model_mode": "text2image", "resolution": "256", "aspect_ratio": "1,1",
         "seed": 7},
        {"id": "s", "prompt": "a red cube", "num_frames": 1, "size": "256x256", "seed": 7,
         "num_inference_steps": 50, "guidance_scale": 4.0, "flow_shift": 3.0},
    ),
    "image2video": (
        {"prompt": "a cat", "vision_path": "c.png", "num_frames": 6, "resolution": "480",
         "aspect_ratio": "4,3"},
        {"id": "s", "prompt": "a cat", "image": "c.png", "num_frames": 9, "size": "736x544", "fps": 24,
         "num_inference_steps": 35, "guidance_scale": 6.0, "flow_shift": 10.0},
    ),
    "video2video": (
        {"prompt": "a dog", "vision_path": "clip.mp4", "num_steps": 2, "guidance": 3.5, "shift": 5.0,
         "fps": 12, "num_frames": 9, "resolution": "256", "condition_video_keep": "last"},
        {"id": "s", "prompt": "a dog", "video": "clip.mp4", "num_frames": 9, "size": "320x192", "fps": 12,
         "num_inference_steps": 2, "guidance_scale": 3.5, "flow_shift": 5.0, "condition_video_keep": "last"},
    ),
    "policy": (
        {"prompt": "pick it", "model_mode": "policy", "vision_path": "c.png", "domain_name": "fractal",
         "action_chunk_size": 4, "view_point": "wrist_view"},
        {"id": "s", "prompt": "pick it", "image": "c.png", "num_inference_steps": 30, "guidance_scale": 1.0,
         "action": {"mode": "policy", "chunk_size": 4, "domain": "fractal", "resolution_tier": 256,
                    "viewpoint": "wrist_view"}},
    ),
    "forward_dynamics": (
        {"prompt": "roll", "model_mode": "forward_dynamics", "vision_path": "c.png", "domain_name": "fractal",
         "action_chunk_size": 4, "action_path": "acts.json", "image_size": 480, "seed": 1},
        {"id": "s", "prompt": "roll", "image": "c.png", "num_inference_steps": 30, "guidance_scale": 1.0,
         "seed": 1, "action": {"mode": "forward_dynamics", "chunk_size": 4, "domain": "fractal",
                               "resolution_tier": 480, "actions": "acts.json"}},
    ),
    "transfer": (
        {"prompt": "a real street", "vision_path": "clip.mp4", "edge": {"control_path": "clip.mp4"},
         "aspect_ratio": "16,9", "resolution": "256", "num_video_frames_per_chunk": 9},
        {"id": "s", "prompt": "a real street", "video": "clip.mp4", "control": {"edge": "clip.mp4"},
         "size": "320x192", "fps": 24, "num_inference_steps": 35, "guidance_scale": 3.0, "flow_shift": 10.0,
         "control_guidance": 1.5, "frames_per_chunk": 9, "conditional_frames": 1},
    ),
}  # fmt: skip


@pytest.mark.parametrize("mode", CASES)
def test_each_mode_resolves_to_the_same_request_as_ours(media, mode):
    sample, ours = CASES[mode]
    theirs, mine = both(media, sample, ours)
    assert len(theirs) == 1 and where_free(theirs) == where_free(mine)
    assert theirs[0].sample == "s" and theirs[0].source == str(media / "s.json")


def test_a_jsonl_and_a_yaml_of_several_name_their_samples_as_nvidia_does(media):
    rows = [CASES["text2image"][0], CASES["image2video"][0], {**CASES["video2video"][0], "name": "v"}]
    (media / "batch.jsonl").write_text(
        json.dumps(rows[0]) + "\n\n" + "\n".join(map(json.dumps, rows[1:])) + "\n"
    )
    (media / "one.yaml").write_text(
        'prompt: a red cube\nmodel_mode: text2image\nresolution: "256"\nseed: 7\n'
    )
    theirs = load_requests([media / "batch.jsonl", media / "one.yaml"], input_format=NVIDIA)[0]
    ours = [{**CASES["text2image"][1], "id": "batch_0"}, {**CASES["image2video"][1], "id": "batch_1"},
            {**CASES["video2video"][1], "id": "v"},
            {**CASES["text2image"][1], "id": "one", "size": "320x192"}]  # fmt: skip
    mine = load_requests(write_jsonl(media / "ours.jsonl", ours))[0]
    assert where_free(theirs) == where_free(mine)
    assert [(r.sample, r.line) for r in theirs] == [("batch_0", 1), ("batch_1", 3), ("v", 4), ("one", 1)]


def test_num_outputs_gives_that_many_requests_with_nvidia_seeds(media):
    (media / "three.json").write_text(json.dumps({**CASES["text2image"][0], "num_outputs": 3}))
    requests = load_requests(media / "three.json", input_format=NVIDIA)[0]
    assert [(r.id, r.seed, r.sample) for r in requests] == [
        ("three-0", 7, "three"),
        ("three-1", 8, "three"),
        ("three-2", 9, "three"),
    ]


def refusals(tmp_path, name: str, text: str) -> list[str]:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(RequestFileError) as caught:
        load_requests(path, input_format=NVIDIA)
    return [str(error) for error in caught.value.errors]


def test_unknown_keys_urls_and_unsupported_options_are_refused_by_name(tmp_path):
    sample = {"prompt": "x", "vision_path": "https://example.com/a.png", "num_frame": 9,
              "prompt_upsampling": True, "normalize_cfg": True}  # fmt: skip
    text = json.dumps(sample, indent=2)
    assert refusals(tmp_path, "bad.json", text) == [
        "line 3, field 'vision_path': 'https://example.com/a.png' is a URL: this tool downloads nothing; "
        "download it and give its path",
        "line 4, field 'num_frame': unknown key: NVIDIA's cosmos-framework samples have no such field "
        "(did you mean 'num_frames'?)",
        "line 5, field 'prompt_upsampling': not supported: NVIDIA's upsampler (its template, its fixed seed) "
        "is not run: drop the field and pass --upsample for this project's own, recorded per output "
        "(docs/chain.md)",
        "line 6, field 'normalize_cfg': not supported: diffusers' pipeline has no CFG normalization",
    ]
    assert refusals(tmp_path, "r.yaml", "prompt: why\nmodel_mode: text2image\ntemperature: 0.7\n") == [
        "line 3, field 'temperature': is a reasoner field: it needs model_mode reasoner"
    ]
    assert refusals(tmp_path, "g.yaml", "prompt: why\nmodel_mode: reasoner\nnum_steps: 4\n") == [
        "line 3, field 'num_steps': is a generation field: a reasoner sample has text out "
        "(model_mode reasoner)"
    ]


def test_a_reasoner_sample_is_a_reason_request(media):
    # NVIDIA's example: {"model_mode": "reasoner", "prompt": ..., "vision_path": "robot_pouring.mp4"}.
    sample = {"model_mode": "reasoner", "prompt": "Describe what is happening in this video in one sentence.",
              "vision_path": "clip.mp4", "do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
              "presence_penalty": 1.5, "max_new_tokens": 64, "seed": 3407, "video_fps": 4}  # fmt: skip
    ours = {"id": "s", "prompt": sample["prompt"], "video": "clip.mp4", "seed": 3407,
            "reason": {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
                       "presence_penalty": 1.5, "max_new_tokens": 64, "video_fps": 4}}  # fmt: skip
    theirs, mine = both(media, sample, ours)
    assert where_free(theirs) == where_free(mine) and theirs[0].kind == "reason"
    sample = {"model_mode": "reasoner", "prompt": "what is this?", "vision_path": "c.png"}
    ours = {"id": "i", "prompt": "what is this?", "image": "c.png", "reason": {}}
    image, _ = both(media, sample, ours, name="i")
    assert image[0].kind == "reason" and image[0].image == str(media / "c.png")
    assert image[0].reason.max_new_tokens == 1024 and not image[0].reason.do_sample  # NVIDIA's defaults too


def test_duplicate_names_are_an_error_as_in_nvidias_cli(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"prompt": "x", "num_frames": 1}))
    (tmp_path / "b.jsonl").write_text(json.dumps({"prompt": "y", "num_frames": 1, "name": "a"}) + "\n")
    with pytest.raises(RequestFileError) as caught:
        load_requests([tmp_path / "a.json", tmp_path / "b.jsonl"], input_format=NVIDIA)
    assert [str(e) for e in caught.value.errors] == [
        f"line 1, field 'name': duplicate name 'a': already used on line 1 of {tmp_path / 'a.json'}"
    ]


def test_a_file_with_only_nvidia_keys_is_detected_with_a_log_line(tmp_path, caplog):
    (tmp_path / "d.json").write_text(json.dumps({"prompt": "x", "num_steps": 3, "resolution": "256"}))
    with caplog.at_level(logging.INFO, logger="cosmos3_batch"):
        requests = load_requests(tmp_path / "d.json")[0]
    assert [(r.id, r.num_inference_steps, r.width, r.height) for r in requests] == [("d", 3, 320, 192)]
    assert caplog.messages == [
        f"{tmp_path / 'd.json'}: read as NVIDIA cosmos-framework samples (--input-format cosmos-framework): "
        "its keys num_steps, resolution are that format's and not this tool's"
    ]


def test_bad_sample_exits_2_before_loading_and_plan_json_shows_the_mapping(tmp_path, tiny_ckpt):
    (tmp_path / "bad.json").write_text(json.dumps({"prompt": "x", "sigma_max": 80}))
    result = run(tiny_ckpt, tmp_path / "bad.json", tmp_path / "out", "--input-format", NVIDIA)
    assert result.exit_code == 2 and "field 'sigma_max': not supported: is the EDM sampler's" in result.output
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").glob("*.json"))
    (tmp_path / "ok.json").write_text(json.dumps({"prompt": "x", "num_frames": 6, "resolution": "256"}))
    result = invoke("plan", tmp_path / "ok.json", "--input-format", NVIDIA, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["cosmos_framework_samples"] == [
        {
            "name": "ok",
            "file": str(tmp_path / "ok.json"),
            "line": 1,
            "model_mode": "text2video",
            "request": {"id": "ok", "prompt": "x", "num_frames": 9, "size": "320x192",
                        "num_inference_steps": 35, "guidance_scale": 6.0, "flow_shift": 10.0, "fps": 24.0},
            "defaults": ["aspect_ratio", "num_steps", "guidance", "shift", "fps"],
            "notes": ["num_frames 6 rounded up to 9 (4k+1), as NVIDIA's CLI does"],
        }
    ]  # fmt: skip


def test_a_run_of_nvidia_samples_equals_the_same_requests_in_ours(tmp_path, tiny_ckpt):
    samples = [
        {"prompt": "a red cube", "num_frames": 1, "resolution": "256", "aspect_ratio": "3,4", "num_steps": 2,
         "seed": 5},
        {"name": "vid", "prompt": "a cat", "num_frames": 5, "resolution": "256", "num_steps": 1, "fps": 8},
    ]  # fmt: skip
    (tmp_path / "n.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    ours = [
        {"id": "n_0", "prompt": "a red cube", "num_frames": 1, "size": "256x320", "num_inference_steps": 2,
         "seed": 5, "guidance_scale": 4.0, "flow_shift": 3.0},
        {"id": "vid", "prompt": "a cat", "num_frames": 5, "size": "320x192", "num_inference_steps": 1,
         "fps": 8, "guidance_scale": 6.0, "flow_shift": 10.0},
    ]  # fmt: skip
    result = run(tiny_ckpt, tmp_path / "n.jsonl", tmp_path / "a", "--input-format", NVIDIA, "--save-latents")
    assert result.exit_code == 0, result.output
    result = run(tiny_ckpt, write_jsonl(tmp_path / "o.jsonl", ours), tmp_path / "b", "--save-latents")
    assert result.exit_code == 0, result.output
    assert_same_outputs(tmp_path / "b", tmp_path / "a", ["n_0", "vid"])
    sidecar = json.loads((tmp_path / "a" / "vid.json").read_text())
    assert sidecar["sample"] == {"name": "vid", "file": str(tmp_path / "n.jsonl")}
    assert sidecar["request"] == json.loads((tmp_path / "b" / "vid.json").read_text())["request"]
