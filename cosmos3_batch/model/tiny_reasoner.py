"""What `make-tiny --reasoner` writes beside the base parts (DESIGN.md §21): the reasoner's own files, as
transformers' `Cosmos3OmniForConditionalGeneration` reads a unified checkpoint. A root `config.json` of type
`cosmos3_omni` (its text config the tiny transformer's UND sizes, a 1-block ViT), the ViT's flat keys in
`vision_encoder/model.safetensors`, a root `model.safetensors.index.json` naming the transformer's own file
and the ViT's (no second copy of any weight), and the processor and tokenizer files with the vision special
tokens at the tiny vocabulary's ids. Nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import torch

# The vision special tokens a Qwen3-VL processor looks up (<|vision_start|> is in every tiny tokenizer).
REASONER_TOKENS = ("<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
VISION_FOLDER = "vision_encoder"
VISION_FILE = f"{VISION_FOLDER}/model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Qwen3-VL's chat template, reduced to what the tiny tokenizer has: content as text or a list of parts.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PATCH, MERGE, TEMPORAL_PATCH = 16, 2, 2


def vision_config(out_hidden: int) -> dict:
    """A 1-block ViT whose one block also feeds deepstack (so the deepstack add into layer 0 is exercised)."""
    return {
        "model_type": "qwen3_vl_vision",
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "in_channels": 3,
        "patch_size": PATCH,
        "spatial_merge_size": MERGE,
        "temporal_patch_size": TEMPORAL_PATCH,
        "out_hidden_size": out_hidden,
        "num_position_embeddings": 64,
        "deepstack_visual_indexes": [0],
    }


def omni_config(transformer: dict, ids: dict[str, int], dtype: str) -> dict:
    """The root config: the text config is the transformer's UND half, sizes and rotary as it has them."""
    axes = transformer["rope_axes_dim"]
    text = {
        "model_type": "qwen3_vl_text",
        "hidden_size": transformer["hidden_size"],
        "intermediate_size": transformer["intermediate_size"],
        "num_hidden_layers": transformer["num_hidden_layers"],
        "num_attention_heads": transformer["num_attention_heads"],
        "num_key_value_heads": transformer["num_key_value_heads"],
        "head_dim": transformer["head_dim"],
        "vocab_size": transformer["vocab_size"],
        "hidden_act": transformer["hidden_act"],
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": transformer["rope_theta"],
            "mrope_section": list(axes),
            "mrope_interleaved": True,
        },
        "tie_word_embeddings": False,
        "dtype": dtype,
    }
    return {
        "model_type": "cosmos3_omni",
        "architectures": ["Cosmos3OmniForConditionalGeneration"],
        "text_config": text,
        "vision_config": vision_config(transformer["hidden_size"]),
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "tie_word_embeddings": False,
        "dtype": dtype,
    }


def write_reasoner(folder: Path, tokenizer, seed: int, dtype: torch.dtype) -> None:
    """The reasoner's files under `folder`, which already holds transformer/ and text_tokenizer/."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    transformer = json.loads((folder / "transformer" / "config.json").read_text())
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in tokenizer.all_special_tokens}
    config = omni_config(transformer, ids, str(dtype).removeprefix("torch."))
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed + 1)
        vit = Qwen3VLVisionModel(Qwen3VLVisionConfig(**config["vision_config"]))
    finally:
        torch.random.set_rng_state(state)
    weights = {name: p.detach().to(dtype).contiguous() for name, p in vit.state_dict().items()}
    (folder / VISION_FOLDER).mkdir()
    save_file(weights, str(folder / VISION_FILE), metadata={"format": "pt"})
    weight_map = dict.fromkeys(weights, VISION_FILE)
    for path in sorted((folder / "transformer").glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            weight_map.update(dict.fromkeys(f.keys(), f"transformer/{path.name}"))
    index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (folder / "generation_config.json").write_text(
        json.dumps({"eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"]}, indent=2) + "\n"
    )
    _write_processor(folder, tokenizer)


def _write_processor(folder: Path, tokenizer) -> None:
    """Tokenizer files, the image processor's and the processor's (Qwen3-VL's), at the folder's root."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    image = Qwen2VLImageProcessorPil(
        patch_size=PATCH,
        temporal_patch_size=TEMPORAL_PATCH,
        merge_size=MERGE,
        size={"shortest_edge": 32 * 32, "longest_edge": 128 * 128},
    )
    base_template = tokenizer.chat_template
    tokenizer.chat_template = CHAT_TEMPLATE  # the root's (chat_template.jinja): string or list content
    try:
        tokenizer.save_pretrained(folder)
    finally:
        tokenizer.chat_template = base_template
    image.save_pretrained(folder)
    # The video processor's settings, written as its save_pretrained writes them (the class needs torchvision,
    # which make-tiny does not): the ViT's patching, a tiny pixel budget, transformers' frame sampling.
    video = {
        "video_processor_type": "Qwen3VLVideoProcessor",
        "patch_size": PATCH,
        "temporal_patch_size": TEMPORAL_PATCH,
        "merge_size": MERGE,
        "size": {"shortest_edge": 32 * 32 * 2, "longest_edge": 64 * 64 * 8},
        "fps": 2,
        "min_frames": 2,
        "max_frames": 16,
    }
    (folder / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2) + "\n")
    processor = {"processor_class": "Qwen3VLProcessor"}
    (folder / "processor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
