"""`plan` on an FP8 checkpoint: it reads the e4m3 sizes (and scales) from the headers, so every byte
figure is about half that of the bf16 source, and it says what the weights are."""

from __future__ import annotations

from pathlib import Path

from cosmos3_batch.checkpoint.convert import convert_fp8
from cosmos3_batch.checkpoint.folder import Checkpoint
from cosmos3_batch.model.loading import decoder_linear_weights
from cosmos3_batch.model.tiny import TinySpec, write_tiny
from cosmos3_batch.plan.hardware import Hardware
from cosmos3_batch.plan.job_plan import plan_job
from cosmos3_batch.plan.model_shape import model_shape
from tests.conftest import write_jsonl
from tests.unit.test_fp8_fidelity import ROWS


def test_plan_counts_fp8_bytes(tmp_path: Path) -> None:
    bf16 = write_tiny(tmp_path / "bf16", TinySpec(dtype="bfloat16"))
    fp8 = tmp_path / "fp8"
    convert_fp8(bf16, fp8, decoder_linear_weights)
    prompts = write_jsonl(tmp_path / "p.jsonl", ROWS)
    docs = {}
    for name, ckpt in (("bf16", bf16), ("fp8", fp8)):
        docs[name], text = plan_job(prompts, ckpt, 2, 1, "allgather", 2, Hardware())
        assert "layer weights:" in text
    assert docs["fp8"]["weights"]["fp8"] and not docs["bf16"]["weights"]["fp8"]
    assert "fp8" in docs["fp8"]["weights"]["format"] and docs["bf16"]["weights"]["format"] == "bfloat16"
    ratio = docs["fp8"]["weights"]["layer_gib"] / docs["bf16"]["weights"]["layer_gib"]
    assert 0.45 < ratio <= 0.6, ratio
    sim = {k: d["simulation"] for k, d in docs.items()}
    assert sim["fp8"]["passes"] == sim["bf16"]["passes"]
    assert sim["fp8"]["bytes_per_rank"] <= 0.6 * sim["bf16"]["bytes_per_rank"]
    # Activations stay in the unquantized dtype; the scales are laid out with the weights.
    shape = model_shape(Checkpoint.open(fp8), 2, None)
    assert shape.act_bytes == 2
    names = {p.spec.name for part in shape.parts for p in part.params}
    assert "layers.0.mlp.up_proj.weight_quantizer._scale" in names
