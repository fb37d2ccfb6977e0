"""`make-tiny --vocab N`: a large embedding table of padding rows; the default model is untouched."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from cosmos3_batch.checkpoint.reader import TensorStore
from cosmos3_batch.cli import app
from cosmos3_batch.model.tiny import TinySpec, build_tokenizer, spec_record


def test_vocab_sets_the_table_rows_and_nothing_else(tmp_path):
    tokens = len(build_tokenizer())
    args = ("--layers", "1", "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--intermediate", "48")
    runner = CliRunner()
    assert runner.invoke(app, ["make-tiny", str(tmp_path / "plain"), *args]).exit_code == 0
    assert runner.invoke(app, ["make-tiny", str(tmp_path / "wide"), *args, "--vocab", "5000"]).exit_code == 0
    for name, rows in (("plain", tokens), ("wide", 5000)):
        config = json.loads((tmp_path / name / "transformer" / "config.json").read_text())
        store = TensorStore(tmp_path / name / "transformer")
        assert config["vocab_size"] == rows
        assert store.info("embed_tokens.weight")[1] == (rows, 32)
    assert json.loads((tmp_path / "wide" / "tiny_spec.json").read_text())["vocab"] == 5000
    assert "vocab" not in json.loads((tmp_path / "plain" / "tiny_spec.json").read_text())
    bad = runner.invoke(app, ["make-tiny", str(tmp_path / "bad"), *args, "--vocab", str(tokens - 1)])
    assert bad.exit_code == 2 and f"tokenizer's {tokens} tokens" in bad.output


def test_default_model_folder_and_spec_file_are_unchanged_by_the_new_field():
    # The default spec serialises exactly as before `vocab` existed, so its cache folder (a hash of it)
    # and its tiny_spec.json keep their names and bytes.
    spec = spec_record(TinySpec())
    assert "vocab" not in spec
    assert list(spec) == [
        "seed", "layers", "hidden", "heads", "kv_heads", "intermediate", "dtype", "latent_channels",
        "vae_dim", "flow_shift",
    ]  # fmt: skip
