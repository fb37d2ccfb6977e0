"""--format webdataset: a finished request's members, encoded into its writer's staging folder before they are
appended to the open shard of its kind (DESIGN.md §12; the members: docs/outputs.md)."""

from __future__ import annotations

import json
from pathlib import Path

from cosmos3_batch.io import outputs
from cosmos3_batch.io.audio import write_wav_file
from cosmos3_batch.io.shards import ShardWriter
from cosmos3_batch.io.text_outputs import chain_members

# The sidecar's `files` key of each member suffix (the rest: latents).
FILE_KEYS = {"png": "media", "mp4": "media", "txt": "media", "wav": "wav", "actions.safetensors": "actions"}

# What a shard's index keeps of each sample's sidecar: resume's checks and the manifest's columns.
INDEXED = ("id", "kind", "request", "request_hash", "output_key", "inputs", "seed", "timings", "model",
           "model_digest", "rank", "upsample", "captions")  # fmt: skip


def stage_media(
    shards: ShardWriter, key: str, r, result, save_latents: bool, staged: list[tuple[str, Path]]
) -> str:
    """Encode the output's members, appending each (suffix, staged path) to `staged` as it is made (the caller
    removes them on a failure); returns the media's suffix. A reasoner's output is its text (`txt`, UTF-8 as
    the files format's `<id>.txt`), else the PNG or MP4 with its sound, actions and latents."""
    if r.reason is not None:
        staged.append(("txt", shards.stage(key, "txt")))
        staged[-1][1].write_bytes(result.text.encode("utf-8"))
        return "txt"
    frames = outputs.to_uint8(result.frames)
    audio = (result.sound, result.sample_rate) if result.sound is not None else None
    media = "png" if r.num_frames == 1 else "mp4"
    staged.append((media, shards.stage(key, media)))
    if media == "png":
        outputs.render_png(staged[-1][1], frames[0])
    else:
        outputs.render_mp4(staged[-1][1], frames, r.fps, audio, final=staged[-1][1])
    if audio is not None:
        staged.append(("wav", shards.stage(key, "wav")))
        write_wav_file(staged[-1][1], *audio)
    if result.actions is not None:
        staged.append(("actions.safetensors", shards.stage(key, "actions.safetensors")))
        outputs.render_actions(staged[-1][1], result.actions)
    if save_latents:
        staged.append(("latents.safetensors", shards.stage(key, "latents.safetensors")))
        outputs.render_latents(staged[-1][1], result.latents, result.sound)
    return media


def files_record(key: str, staged: list[tuple[str, Path]]) -> dict:
    """The sidecar's `files`: each staged member's name in the shard and its size."""
    return {FILE_KEYS.get(sfx, "latents"): {"name": f"{key}.{sfx}", "bytes": path.stat().st_size}
            for sfx, path in staged}  # fmt: skip


def stage_texts(shards: ShardWriter, key: str, r, sidecar: dict, staged: list[tuple[str, Path]]) -> None:
    """The sidecar (`json`), the prompt and the chained texts (`caption.txt`, ...). The prompt is `txt`, a
    loader's text of the sample; a reasoner's `txt` is the text it generated: its prompt is `prompt.txt`."""
    texts = {"json": json.dumps(sidecar, indent=2, sort_keys=True) + "\n"}
    texts["prompt.txt" if r.reason is not None else "txt"] = r.prompt_original or r.prompt
    texts |= chain_members(sidecar)
    for suffix, text in texts.items():
        staged.append((suffix, shards.stage(key, suffix)))
        staged[-1][1].write_bytes(text.encode("utf-8"))
