"""Output bookkeeping for the mode files: completeness requires them, stale temporaries are cleaned."""

from __future__ import annotations

import json
from types import SimpleNamespace

from cosmos3_batch.io import outputs
from cosmos3_batch.requests.actions import ActionSpec


def test_stale_temporaries_of_mode_files_are_removed_for_these_ids_only(tmp_path):
    mine = [
        ".x.123.ab_c.tmp.wav",
        ".x.silent.123.k9z.tmp.mp4",
        ".x.actions.123.q1w.tmp.safetensors",
        ".x.actions.123.e2r.tmp.json",
    ]
    other = [".y.123.ab_c.tmp.wav", ".y.actions.123.e2r.tmp.json", "x.actions.json"]
    for name in mine + other:
        (tmp_path / name).write_text("")
    assert outputs.remove_stale_temporaries(tmp_path, {"x"}) == len(mine)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(other)


def test_completeness_requires_the_mode_files(tmp_path):
    paths = outputs.paths_for(tmp_path, "r", 9)
    paths.media.write_bytes(b"mp4")
    sidecar = {"status": "complete", "request_hash": "h", "output_key": "k"}
    sidecar["files"] = {"media": {"name": "r.mp4", "bytes": 3}}
    paths.sidecar.write_text(json.dumps(sidecar))
    sound = SimpleNamespace(sound=True, action=None)
    policy = SimpleNamespace(sound=False, action=ActionSpec("policy", 4, "fractal", 256, "ego_view"))
    forward = SimpleNamespace(
        sound=False, action=ActionSpec("forward_dynamics", 4, "fractal", 256, "ego_view")
    )
    assert outputs.mode_files(sound) == ("wav",)
    assert outputs.mode_files(policy) == ("actions", "actions_json")
    assert outputs.mode_files(forward) == ()  # given its actions, it writes none
    assert outputs.is_complete(paths, "h", "k", False, outputs.mode_files(forward)) == (True, "")
    done, why = outputs.is_complete(paths, "h", "k", False, outputs.mode_files(sound))
    assert not done and why == "sidecar lists no wav file"
    paths.wav.write_bytes(b"RIFF")
    sidecar["files"]["wav"] = {"name": "other.wav", "bytes": 4}  # a name that is not this request's file
    paths.sidecar.write_text(json.dumps(sidecar))
    assert not outputs.is_complete(paths, "h", "k", False, ("wav",))[0]
    sidecar["files"]["wav"] = {"name": "r.wav", "bytes": 4}
    paths.sidecar.write_text(json.dumps(sidecar))
    assert outputs.is_complete(paths, "h", "k", False, ("wav",)) == (True, "")
