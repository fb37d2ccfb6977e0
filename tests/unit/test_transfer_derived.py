"""Derived controls (`"edge": "auto"`, `"blur": "auto"`, DESIGN.md §17): the frames equal OpenCV called
directly with NVIDIA's "medium" presets (cosmos-transfer2.5's AddControlInputEdge / AddControlInputBlur,
use_random=False) on the request's video as NVIDIA reads it (INTER_AREA to the output size), and a Transfer
run with derived controls equals `Cosmos3OmniModularPipeline` given those same frames, bit for bit."""

from __future__ import annotations

import cv2
import imageio
import numpy as np
import pytest
import torch
from diffusers.utils import load_video

from cosmos3_batch.pipeline.kinds.transfer.controls import derive
from cosmos3_batch.requests.parse import load_requests
from tests.conftest import write_jsonl
from tests.reference import transfer_outputs, transfer_reference
from tests.unit.test_fidelity import run_ours

pytestmark = pytest.mark.exact

SIZE = (32, 48)  # (h, w) of the requests below


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("derived")
    y, x = np.mgrid[0:48, 0:64]
    frames = []
    for i in range(9):  # a gradient with a disc moving across it: edges and texture to blur
        frame = np.stack([x * 4, y * 5, (x + y) * 2], axis=2).astype(np.uint8)
        frame[(x - 12 - 4 * i) ** 2 + (y - 24) ** 2 < 81] = (250, 40, 10)
        frames.append(frame)
    imageio.mimwrite(folder / "rgb.mp4", frames, fps=8)
    return folder


def nvidia_edge(frame: np.ndarray) -> np.ndarray:
    return np.repeat(cv2.Canny(frame, 100, 200)[..., None], 3, axis=2)


def nvidia_blur(frames: list[np.ndarray]) -> np.ndarray:
    """AddControlInputBlur, "medium": INTER_AREA / 2, bilateralFilter(30, 150, 100) once, INTER_LINEAR back,
    then torchvision's bicubic antialiased resize of the C,T,H,W uint8 tensor to 1/10 and back."""
    h, w = frames[0].shape[:2]
    blurred = [
        cv2.resize(
            cv2.bilateralFilter(cv2.resize(f, (w // 2, h // 2), interpolation=cv2.INTER_AREA), 30, 150, 100),
            (w, h),
            interpolation=cv2.INTER_LINEAR,
        )
        for f in frames
    ]
    video = torch.from_numpy(np.stack(blurred)).permute(3, 0, 1, 2)  # C, T, H, W as NVIDIA holds it
    for size in ((int(h / 10), int(w / 10)), (h, w)):
        video = torch.nn.functional.interpolate(
            video.float(), size=size, mode="bicubic", align_corners=False, antialias=True
        )
        video = video.clamp(0, 255).round().to(torch.uint8)
    return video.permute(1, 2, 3, 0).numpy()


def read_as_nvidia(path) -> list[np.ndarray]:
    size = (SIZE[1], SIZE[0])
    return [cv2.resize(np.asarray(f), size, interpolation=cv2.INTER_AREA) for f in load_video(str(path))]


def test_derived_frames_are_opencv_with_nvidias_presets(folder):
    video = load_video(str(folder / "rgb.mp4"))
    frames = read_as_nvidia(folder / "rgb.mp4")
    edges = np.stack([np.asarray(f) for f in derive("edge", video, SIZE)])
    assert np.array_equal(edges, np.stack([nvidia_edge(f) for f in frames]))
    assert 0 < (edges == 255).mean() < 0.5 and set(np.unique(edges)) == {0, 255}  # edges found, not all
    blurred = np.stack([np.asarray(f) for f in derive("blur", video, SIZE)])
    assert np.array_equal(blurred, nvidia_blur(frames))
    assert blurred.shape == (9, *SIZE, 3) and not np.array_equal(blurred, np.stack(frames))


def test_a_run_with_derived_controls_equals_the_reference_given_those_frames(folder, tiny_ckpt):
    rows = [
        {"id": "edge", "prompt": "a red ball", "control": {"edge": "auto"}, "video": "rgb.mp4", "seed": 1,
         "guidance_scale": 3.0},
        {"id": "both", "prompt": "fog", "control": {"blur": "auto", "edge": "auto"}, "video": "rgb.mp4",
         "num_frames": 5, "control_guidance": 1.5, "seed": 2},
    ]  # fmt: skip
    base = {"size": f"{SIZE[1]}x{SIZE[0]}", "num_inference_steps": 3}
    requests, errors = load_requests(str(write_jsonl(folder / "d.jsonl", [{**base, **r} for r in rows])))
    assert errors == [] and [r.transfer.controls[0][1] for r in requests] == ["auto", "auto"]
    frames = read_as_nvidia(folder / "rgb.mp4")
    given = {"edge": [nvidia_edge(f) for f in frames], "blur": list(nvidia_blur(frames))}
    as_pil = {hint: [_pil(f) for f in value] for hint, value in given.items()}
    reference = transfer_outputs(transfer_reference(tiny_ckpt), requests, controls=as_pil)
    ours, _ = run_ours(tiny_ckpt, requests, 2)
    for r in requests:
        latents, video = reference[r.id]
        assert torch.equal(ours[r.id].latents, latents.float()), r.id
        assert np.array_equal(ours[r.id].frames, video.reshape(ours[r.id].frames.shape)), r.id


def _pil(frame: np.ndarray):
    from PIL import Image

    return Image.fromarray(np.ascontiguousarray(frame))


def test_the_transfer_example_loads_with_its_derived_controls():
    """examples/transfer.jsonl (scripts/demo.sh runs it): every line valid, its controls derived from the
    clip, the chunked one a chain."""
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "transfer.jsonl"
    requests, errors = load_requests(str(example))
    assert errors == [] and [r.kind for r in requests] == ["transfer"] * 3
    assert {path for r in requests for _, path in r.transfer.controls} == {"auto"}
    assert requests[2].transfer.num_chunks > 1


def test_the_sidecar_records_each_control_and_how_a_derived_one_was_made(folder):
    """A control file: its path and sha256; a derived one: the video it came from (sha256), the operator and
    NVIDIA's preset parameters."""
    import hashlib

    from cosmos3_batch.pipeline.kinds.transfer.controls import controls_record

    imageio.mimwrite(folder / "depth.mp4", [np.full((32, 48, 3), 7 * i, np.uint8) for i in range(9)], fps=8)
    control = {"depth": "depth.mp4", "edge": "auto"}
    row = {"prompt": "p", "size": "48x32", "control": control, "video": "rgb.mp4"}
    (r,), errors = load_requests(str(write_jsonl(folder / "s.jsonl", [row])))
    assert errors == []
    digest = {n: hashlib.sha256((folder / n).read_bytes()).hexdigest() for n in ("rgb.mp4", "depth.mp4")}
    assert controls_record(r.transfer) == [
        {"hint": "edge", "derived_from": str(folder / "rgb.mp4"), "sha256": digest["rgb.mp4"],
         "operator": "cv2.Canny", "preset": "medium", "threshold1": 100, "threshold2": 200},
        {"hint": "depth", "path": str(folder / "depth.mp4"), "sha256": digest["depth.mp4"]},
    ]  # fmt: skip
