"""Published configs to plan with before a download: Cosmos3-Nano's transformer and the Wan2.2 VAE it uses.

`plan --model` reads only configs and safetensors headers, so a folder holding these configs (and the
tokenizer) sizes a Nano job exactly; the calibration benchmark (scripts/bench/calibrate_plan.py) and the
planner's tests use them. Super's config is not published offline here, so it has no entry.
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
WAN22_VAE = {  # 48 latent channels, 16x spatial, 4x temporal
    "_class_name": "AutoencoderKLWan", "attn_scales": [], "base_dim": 160, "decoder_base_dim": 256,
    "dim_mult": [1, 2, 4, 4], "dropout": 0.0, "in_channels": 12, "is_residual": True, "num_res_blocks": 2,
    "out_channels": 12, "patch_size": 2, "scale_factor_spatial": 16, "scale_factor_temporal": 4,
    "temperal_downsample": [False, True, True], "z_dim": 48,
}  # fmt: skip
