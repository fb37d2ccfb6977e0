"""Transfer's derived controls (DESIGN.md §17): `"edge": "auto"` and `"blur": "auto"`, computed from the
request's RGB `video` as NVIDIA's Transfer inference derives them on the fly (cosmos-transfer2.5:
`AddControlInputEdge` and `AddControlInputBlur` with `use_random=False` and the "medium" presets its CLI
defaults to; parameters in requests/transfer.py `DERIVED_PARAMS`, recorded in the sidecar).

NVIDIA derives from its input video as read for the model: resized to the output size with INTER_AREA, uint8
RGB. Then, per frame:

- edge: `cv2.Canny(frame, 100, 200)` on the RGB frame, the map repeated over the 3 channels;
- blur: INTER_AREA down by 2, `cv2.bilateralFilter(d=30, sigmaColor=150, sigmaSpace=100)` once, INTER_LINEAR
  back up; then bicubic, antialiased, down by 10 and back up, as torchvision's tensor resize computes it
  (float32 interpolate, clamp to [0, 255], round).

The derived frames go on as a control file's frames do (`preprocess_video`; at the output size already, so
its resize is a copy).
"""

from __future__ import annotations

import numpy as np
import torch

from cosmos3_batch.io.inputs import file_sha256
from cosmos3_batch.requests.transfer import AUTO, DERIVED_PARAMS


def model_frames(video: list, size: tuple[int, int]) -> list[np.ndarray]:
    """The video's frames as NVIDIA reads them for the model: uint8 RGB [H, W, 3] at `size` = (h, w)."""
    import cv2

    height, width = size
    return [
        cv2.resize(np.asarray(frame.convert("RGB")), (width, height), interpolation=cv2.INTER_AREA)
        for frame in video
    ]


def edge(frames: list[np.ndarray]) -> list[np.ndarray]:
    import cv2

    p = DERIVED_PARAMS["edge"]
    return [np.repeat(cv2.Canny(f, p["threshold1"], p["threshold2"])[..., None], 3, axis=2) for f in frames]


def blur(frames: list[np.ndarray]) -> list[np.ndarray]:
    import cv2

    p = DERIVED_PARAMS["blur"]
    out = []
    for frame in frames:
        height, width = frame.shape[:2]
        down = p["downsize"]
        small = cv2.resize(frame, (width // down, height // down), interpolation=cv2.INTER_AREA)
        for _ in range(p["iterations"]):
            small = cv2.bilateralFilter(small, p["d"], p["sigma_color"], p["sigma_space"])
        out.append(cv2.resize(small, (width, height), interpolation=cv2.INTER_LINEAR))
    return _down_up(out, p["down_up"])


def _down_up(frames: list[np.ndarray], factor: int) -> list[np.ndarray]:
    """Bicubic with antialiasing to 1/`factor` of the size and back, as `torchvision.transforms.functional
    .resize` computes it on a uint8 tensor (float32, interpolate, clamp, round)."""
    height, width = frames[0].shape[:2]
    pixels = torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2).to(torch.float32)
    for size in ((int(height / factor), int(width / factor)), (height, width)):
        pixels = torch.nn.functional.interpolate(
            pixels, size=size, mode="bicubic", align_corners=False, antialias=True
        )
        pixels = pixels.clamp(0, 255).round()
    return list(pixels.to(torch.uint8).permute(0, 2, 3, 1).numpy())


OPERATORS = {"edge": edge, "blur": blur}


def derive(hint: str, video: list, size: tuple[int, int]) -> list:
    """The `hint` control derived from `video` (PIL frames) at `size` = (h, w), as PIL RGB frames."""
    from PIL import Image

    return [Image.fromarray(np.ascontiguousarray(f)) for f in OPERATORS[hint](model_frames(video, size))]


def controls_record(spec) -> list[dict]:
    """The sidecar's `controls`, in the order the model sees them: each control file's path and sha256; for a
    derived one, the video it came from (path, sha256) and the operator with its parameters."""
    record = []
    for hint, path in spec.controls:
        if path == AUTO:
            source = {"derived_from": spec.video, "sha256": file_sha256(spec.video)}
            record.append({"hint": hint, **source, **DERIVED_PARAMS[hint]})
        else:
            record.append({"hint": hint, "path": path, "sha256": file_sha256(path)})
    return record
