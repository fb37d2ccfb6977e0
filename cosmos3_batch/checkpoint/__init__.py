"""Checkpoints on disk: the folder, the safetensors reader (byte ranges, mmap), the FP8 format, `convert`."""
