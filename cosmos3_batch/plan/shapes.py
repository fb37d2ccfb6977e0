"""Configs to plan with before a download: Cosmos3-Nano's transformer, the Wan2.2 VAE every release uses,
and shapes for Super (its 4-step distilled checkpoints share its transformer) and Edge.

`plan --model` reads only configs and safetensors headers, so a folder holding these configs (and the
tokenizer) sizes a job; the calibration benchmark (scripts/bench/calibrate_plan.py), the checkpoint-kinds
benchmark (scripts/bench/checkpoint_kinds.py) and the planner's tests use them. Nano's is the published
config. Super's and Edge's configs are not available offline here: SUPER_TRANSFORMER is a Qwen3-32B-shaped
MoT (64 layers, hidden 5120: 63.8B parameters with both halves, the published 64B), EDGE_TRANSFORMER a
Nemotron-Mini-4B-shaped one (relu2, 32 layers, hidden 3072); replace them with the real configs once
downloaded (plan reads the folder's own).
"""

from __future__ import annotations

NANO_TRANSFORMER = {
    "_class_name": "Cosmos3OmniTransformer",
    "hidden_size": 4096,
    "head_dim": 128,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "vocab_size": 151936,
    "latent_channel": 48,
    "patch_latent_dim": 192,
}
SUPER_TRANSFORMER = {
    "_class_name": "Cosmos3OmniTransformer",
    "hidden_size": 5120,
    "head_dim": 128,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "intermediate_size": 25600,
    "num_hidden_layers": 64,
    "vocab_size": 151936,
    "latent_channel": 48,
    "patch_latent_dim": 192,
}
EDGE_TRANSFORMER = {
    "_class_name": "Cosmos3OmniTransformer",
    "hidden_size": 3072,
    "head_dim": 128,
    "num_attention_heads": 24,
    "num_key_value_heads": 8,
    "intermediate_size": 9216,
    "num_hidden_layers": 32,
    "vocab_size": 256000,
    "latent_channel": 48,
    "patch_latent_dim": 192,
    "hidden_act": "relu2",
    "qk_norm_for_text": False,
    "use_und_k_norm_for_gen": True,
}
WAN22_VAE = {  # 48 latent channels, 16x spatial, 4x temporal
    "_class_name": "AutoencoderKLWan", "attn_scales": [], "base_dim": 160, "decoder_base_dim": 256,
    "dim_mult": [1, 2, 4, 4], "dropout": 0.0, "in_channels": 12, "is_residual": True, "num_res_blocks": 2,
    "out_channels": 12, "patch_size": 2, "scale_factor_spatial": 16, "scale_factor_temporal": 4,
    "temperal_downsample": [False, True, True], "z_dim": 48,
}  # fmt: skip
