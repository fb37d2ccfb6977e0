"""NVIDIA cosmos-framework's inference sample schema as data (DESIGN.md §24), for requests/cosmos_framework.py
and docs/requests.md: every field its CLI accepts, what each maps to here or why it is refused, its
resolution table and its per-mode defaults. Torch-free.

Where each fact comes from (NVIDIA/cosmos-framework as stored): the fields are `OmniSampleOverrides` in
cosmos_framework/inference/args.py and `SampleOverrides` in inference/common/args.py (extra="forbid": an
unknown key is an error there too); the sizes are `VIDEO_RES_SIZE_INFO` / `IMAGE_RES_SIZE_INFO` in
cosmos_framework/data/generator/utils.py; the Transfer defaults are `TransferDataOverrides`' tables; the
per-mode sampling defaults live in its defaults/<mode>/sample_args.json, which is not in the stored source:
those values are issue 47's (text2image 50 steps, guidance 4.0, shift 3.0; video modes 35, 6.0, 10, 189
frames at 24 fps; action modes 30 steps, guidance 1.0).
"""

from __future__ import annotations

from dataclasses import dataclass

# Tier -> aspect ratio -> (width, height). Images and videos share these rows for the tiers below; 1080 is
# image-only in NVIDIA's CLI (IMAGE_ONLY_RESOLUTIONS).
SIZES = {
    "256": {"1,1": (256, 256), "4,3": (320, 256), "3,4": (256, 320), "16,9": (320, 192), "9,16": (192, 320)},
    "480": {"1,1": (640, 640), "4,3": (736, 544), "3,4": (544, 736), "16,9": (832, 480), "9,16": (480, 832)},
    "720": {
        "1,1": (960, 960), "4,3": (1104, 832), "3,4": (832, 1104), "16,9": (1280, 720), "9,16": (720, 1280),
    },
    "768": {
        "1,1": (1024, 1024), "4,3": (1184, 880), "3,4": (880, 1184), "16,9": (1360, 768), "9,16": (768, 1360),
    },
    "1080": {
        "1,1": (1440, 1440), "4,3": (1664, 1248), "3,4": (1248, 1664), "16,9": (1920, 1080),
        "9,16": (1080, 1920),
    },
}  # fmt: skip
IMAGE_ONLY = frozenset({"1080"})
DEFAULT_ASPECT = "16,9"  # VisionDataArgs.vision_size: None means 16:9 outside image editing
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")  # its IMAGE_EXTENSIONS
VIDEO_SUFFIXES = (".mp4",)  # its VIDEO_EXTENSIONS
HINTS = ("edge", "blur", "depth", "seg", "wsm")  # TransferHintKey, in its (and our) canonical order
HINT_KEYS = {
    "edge": ("control_path", "weight", "preset_edge_threshold"),
    "blur": ("control_path", "weight", "preset_blur_strength"),
}
PLAIN_HINT_KEYS = ("control_path", "weight")
ACTION_MODES = ("forward_dynamics", "inverse_dynamics", "policy")
VFM_MODES = ("text2image", "text2video", "image2video", "video2video")


@dataclass(frozen=True)
class ModeDefaults:
    steps: int
    guidance: float
    shift: float | None  # None: the checkpoint scheduler's own (NVIDIA's value for the mode is not known)
    num_frames: int | None
    fps: float | None


DEFAULTS = {
    "text2image": ModeDefaults(50, 4.0, 3.0, 1, None),
    "video": ModeDefaults(35, 6.0, 10.0, 189, 24.0),  # text2video, image2video, video2video
    "action": ModeDefaults(30, 1.0, None, None, None),
}
DEFAULT_TIER = {"Cosmos3-Edge": "480"}  # by requests/defaults.py family; every other checkpoint: 720
FALLBACK_TIER = "720"
# TransferDataOverrides: for a sample with one hint, these replace what the sample leaves out.
TRANSFER_DEFAULTS = {
    "edge": {"guidance": 3.0, "control_guidance": 1.5, "shift": 10.0},
    "blur": {"guidance": 3.0, "control_guidance": 1.5, "shift": 10.0},
    "depth": {"guidance": 3.0, "control_guidance": 1.5, "shift": 10.0},
    "seg": {"guidance": 3.0, "control_guidance": 2.0, "shift": 10.0},
    "wsm": {"guidance": 1.0, "control_guidance": 3.0, "shift": 10.0, "num_frames": 101, "fps": 10,
            "num_video_frames_per_chunk": 101},
}  # fmt: skip
TRANSFER_SAMPLE_DEFAULTS = {"num_video_frames_per_chunk": 93, "num_conditional_frames": 1}

REASONER = "reasoner"  # model_mode: the checkpoint's reasoner, text out (this tool's `reason` requests)
# Its sampling fields, the same names in this tool's `reason` object (NVIDIA's defaults are generate's:
# greedy, max_new_tokens 1024, as ours).
REASONER_FIELDS = (
    "max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "repetition_penalty", "presence_penalty",
    "video_fps",
)  # fmt: skip

# NVIDIA field -> the field of this tool's request it becomes (docs/requests.md has the whole table).
MAPPED = {
    **{key: f"reason.{key}" for key in REASONER_FIELDS},
    "name": "id",
    "prompt": "prompt",
    "prompt_path": "prompt",
    "negative_prompt": "negative_prompt",
    "negative_prompt_file": "negative_prompt",
    "seed": "seed",
    "num_outputs": "samples",
    "num_steps": "num_inference_steps",
    "guidance": "guidance_scale",
    "shift": "flow_shift",
    "guidance_interval": "guidance_interval",
    "vision_path": "image / video",
    "resolution": "size",
    "aspect_ratio": "size",
    "num_frames": "num_frames",
    "fps": "fps",
    "condition_frame_indexes_vision": "condition_frames",
    "condition_video_keep": "condition_video_keep",
    "enable_sound": "sound",
    "model_mode": "the mode",
    "action_path": "action.actions",
    "domain_name": "action.domain",
    "action_chunk_size": "action.chunk_size",
    "view_point": "action.viewpoint",
    "image_size": "action.resolution_tier",
    "raw_action_dim": "checked against the domain's width",
    "control_guidance": "control_guidance",
    "control_guidance_interval": "control_guidance_interval",
    **{hint: f"control.{hint}" for hint in HINTS},
    "num_video_frames_per_chunk": "frames_per_chunk",
    "num_conditional_frames": "conditional_frames",
    "num_first_chunk_conditional_frames": "first_chunk_conditional_frames",
}
_NO_TEMPLATE = (
    "NVIDIA's own prompt-template text has no parameter in diffusers' pipeline, which applies its own "
    "templates (extra_params use_resolution_template / use_duration_template)"
)
_UPSAMPLING = (
    "NVIDIA's upsampler (its template, its fixed seed) is not run: drop the field and pass --upsample for "
    "this project's own, recorded per output (docs/chain.md)"
)
# NVIDIA field -> why it is refused. A field in NEUTRAL may still appear with that (no-op) value.
REFUSED = {
    "output_dir": "outputs go to --out, in this tool's layout (docs/outputs.md)",
    "model": "the checkpoint is --model",
    "extra": "has no equivalent here",
    "tensors_file": "precomputed data tensors have no equivalent in diffusers' pipeline",
    "pickle_file": "precomputed data has no equivalent in diffusers' pipeline",
    "defaults_file": "a custom defaults file is not read: NVIDIA's built-in per-mode defaults apply",
    "normalize_cfg": "diffusers' pipeline has no CFG normalization",
    "sigma_max": "is the EDM sampler's; this tool runs the checkpoint's UniPC scheduler, as diffusers does",
    "duration_template": _NO_TEMPLATE,
    "resolution_template": _NO_TEMPLATE,
    "negative_metadata_mode": _NO_TEMPLATE,
    "inverse_duration_template": _NO_TEMPLATE,
    "inverse_resolution_template": _NO_TEMPLATE,
    "negative_prompt_keep_metadata": _NO_TEMPLATE,
    "video_save_quality": "outputs are encoded as this tool encodes them (docs/outputs.md)",
    "image_save_quality": "outputs are encoded as this tool encodes them (docs/outputs.md)",
    "sound_path": "audio conditioning (audio_image2video) has no input in diffusers' pipeline",
    "max_frames": "the frame count is the control's, capped by num_frames: give num_frames instead",
    "show_control_condition": "outputs stay this tool's layout: no control map beside the video",
    "show_input": "outputs stay this tool's layout: no input beside the video",
    "share_vision_temporal_positions": "diffusers' Transfer pipeline has no parameter for it",
    "emphasize_control_in_prompt": "the directive NVIDIA appends to the prompt has no parameter in diffusers",
    "prompt_upsampling": _UPSAMPLING,
    **{f"prompt_upsampler_{key}": _UPSAMPLING for key in ("max_tokens", "temperature", "top_p", "top_k")},
    **{f"prompt_upsampler_{key}": _UPSAMPLING for key in ("repetition_penalty", "presence_penalty", "seed")},
}
# A refused field with the value that does nothing (what NVIDIA's CLI does when the field is left out).
NEUTRAL = {
    "normalize_cfg": False,
    "extra": {},
    "model": "",
    "show_control_condition": False,
    "show_input": False,
    "share_vision_temporal_positions": True,
    "emphasize_control_in_prompt": False,
    "prompt_upsampling": False,
}
REFUSED_MODES = {
    "image2image": "image editing has no mode in diffusers' Cosmos3OmniPipeline",
    "audio_image2video": "audio conditioning has no input in diffusers' Cosmos3OmniPipeline",
}
KNOWN = frozenset(MAPPED) | frozenset(REFUSED)

# This tool's field (as its checks name it) -> the NVIDIA field a user wrote, for error messages.
THEIRS = {
    "id": "name",
    "size": "resolution",
    "width": "resolution",
    "height": "resolution",
    "num_inference_steps": "num_steps",
    "guidance_scale": "guidance",
    "flow_shift": "shift",
    "image": "vision_path",
    "video": "vision_path",
    "condition_frames": "condition_frame_indexes_vision",
    "sound": "enable_sound",
    "samples": "num_outputs",
    "action": "model_mode",
    "action.mode": "model_mode",
    "action.chunk_size": "action_chunk_size",
    "action.domain": "domain_name",
    "action.resolution_tier": "image_size",
    "action.viewpoint": "view_point",
    "action.actions": "action_path",
    "frames_per_chunk": "num_video_frames_per_chunk",
    "conditional_frames": "num_conditional_frames",
    "first_chunk_conditional_frames": "num_first_chunk_conditional_frames",
    **{f"control.{hint}": f"{hint}.control_path" for hint in HINTS},
}
