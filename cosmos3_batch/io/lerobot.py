"""`cosmos3-batch export lerobot OUT DST --fps F`: action outputs as a LeRobot v3.0 dataset.

One episode per complete policy / inverse-dynamics / forward-dynamics request (by id), one row per action
step t: `action` = row t of `<id>.actions.safetensors` exactly (forward dynamics: the actions it was given),
`frame_index` = t, `timestamp` = t / F, the request's prompt as its task, its clip under
videos/observation.images.main/ (copied as written when its fps is F, else its frames re-encoded at F).
Layout (LeRobot's own constants: `meta/info.json`, `meta/tasks.parquet`, `meta/episodes/chunk-XXX/
file-XXX.parquet`, `data/chunk-XXX/file-XXX.parquet`, `videos/<key>/chunk-XXX/file-XXX.mp4`): docs/outputs.md.
Written into a temporary sibling of DST and renamed into place, so DST is whole or absent.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from cosmos3_batch.io.catalog import Output, complete_outputs

VERSION = "v3.0"
VIDEO_KEY = "observation.images.main"
CHUNKS_SIZE = 1000  # files per chunk folder (LeRobot's default)
EPISODES_PER_DATA_FILE = 1000
ACTION_MODES = ("policy", "inverse_dynamics", "forward_dynamics")
DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
INDEX_COLUMNS = ("frame_index", "episode_index", "index", "task_index")
EPISODES_PATH = "meta/episodes/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"


def export_lerobot(out: Path, dst: Path, fps: float, domain: str | None = None) -> dict:
    """Write DST; returns {"episodes", "frames", "tasks"}. ValueError for a DST that holds something, no
    action outputs, or episodes that cannot share one dataset (action widths or frame sizes differ)."""
    if fps <= 0:
        raise ValueError(f"--fps must be > 0, got {fps}")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ValueError(f"DST {dst}: must be a new or empty folder")
    episodes = _episodes(out, domain)
    actions = [_actions(out, o) for o in episodes]
    widths = sorted({a.shape[1] for a in actions})
    if len(widths) > 1:
        raise ValueError(f"action widths differ ({widths}): export one domain at a time (--domain)")
    tmp = dst.with_name(f".{dst.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        shape = _write_videos(out, tmp, episodes, fps)
        tasks = sorted({o.record["request"]["prompt"] for o in episodes})
        _write_data(tmp, episodes, actions, tasks, fps)
        _write_meta(tmp, episodes, actions, tasks, fps, shape)
        if dst.exists():
            dst.rmdir()
        tmp.rename(dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"episodes": len(episodes), "frames": sum(len(a) for a in actions), "tasks": len(tasks)}


def _episodes(out: Path, domain: str | None) -> list[Output]:
    chosen = []
    for _, output in sorted(complete_outputs(out).items()):
        action = (output.record.get("request") or {}).get("action") or {}
        if action.get("mode") in ACTION_MODES and (domain is None or action.get("domain") == domain):
            chosen.append(output)
    if not chosen:
        raise ValueError(f"{out}: no complete action outputs{f' of domain {domain}' if domain else ''}")
    return chosen


def _actions(out: Path, output: Output) -> np.ndarray:
    """[T, D] float32: the predicted rows as written, or forward dynamics' given rows."""
    from safetensors.numpy import load

    if output.has("actions.safetensors"):
        return load(output.read(out, "actions.safetensors"))["actions"].astype(np.float32, copy=False)
    given = output.record["request"]["action"].get("actions")
    if isinstance(given, str):  # a .npy or .json file named by the request
        given = np.load(given) if given.endswith(".npy") else json.loads(Path(given).read_text())
    return np.asarray(given, dtype=np.float32)


def _location(episode: int) -> tuple[int, int]:
    return episode // CHUNKS_SIZE, episode % CHUNKS_SIZE


def _write_videos(out: Path, root: Path, episodes: list[Output], fps: float) -> tuple[int, int]:
    """Each episode's clip as its own video file; returns the (height, width) they share."""
    sizes = set()
    for number, output in enumerate(episodes):
        chunk, file = _location(number)
        path = root / VIDEO_PATH.format(video_key=VIDEO_KEY, chunk_index=chunk, file_index=file)
        path.parent.mkdir(parents=True, exist_ok=True)
        request = output.record["request"]
        sizes.add((int(request["height"]), int(request["width"])))
        data = output.read(out, "mp4")
        if float(request["fps"]) == float(fps):
            path.write_bytes(data)
        else:
            _reencode(data, path, fps)
    if len(sizes) > 1:
        raise ValueError(f"frame sizes differ ({sorted(sizes)}): export one resolution tier at a time")
    return sizes.pop()


def _reencode(data: bytes, path: Path, fps: float) -> None:
    import imageio.v3 as iio

    from cosmos3_batch.io.outputs import _write_h264

    frames = iio.imread(data, plugin="FFMPEG", extension=".mp4")
    _write_h264(path, np.ascontiguousarray(frames), fps)


def _write_data(root: Path, episodes: list[Output], actions: list[np.ndarray], tasks: list[str], fps: float):
    width = actions[0].shape[1]
    task_index = {task: number for number, task in enumerate(tasks)}
    index = 0
    for first in range(0, len(episodes), EPISODES_PER_DATA_FILE):
        columns: dict[str, list] = {k: [] for k in ("action", "timestamp", *INDEX_COLUMNS)}
        for number in range(first, min(first + EPISODES_PER_DATA_FILE, len(episodes))):
            rows = actions[number]
            task = task_index[episodes[number].record["request"]["prompt"]]
            for t in range(len(rows)):
                columns["action"].append(rows[t])
                columns["timestamp"].append(np.float32(t / fps))
                columns["frame_index"].append(t)
                columns["episode_index"].append(number)
                columns["index"].append(index)
                columns["task_index"].append(task)
                index += 1
        flat = np.concatenate(columns["action"]) if columns["action"] else np.zeros(0, np.float32)
        table = pa.table({
            "action": pa.FixedSizeListArray.from_arrays(pa.array(flat, pa.float32()), width),
            "timestamp": pa.array(columns["timestamp"], pa.float32()),
            **{k: pa.array(columns[k], pa.int64()) for k in INDEX_COLUMNS},
        })  # fmt: skip
        chunk, file = _location(first // EPISODES_PER_DATA_FILE)
        path = root / DATA_PATH.format(chunk_index=chunk, file_index=file)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, path)


def _write_meta(root, episodes, actions, tasks, fps, shape: tuple[int, int]) -> None:
    meta = root / "meta"
    meta.mkdir(parents=True, exist_ok=True)
    width = actions[0].shape[1]
    lengths = [len(a) for a in actions]
    domains = sorted({o.record["request"]["action"]["domain"] for o in episodes})
    rate = int(fps) if float(fps).is_integer() else fps
    video_info = {
        "video.height": shape[0], "video.width": shape[1], "video.codec": "h264", "video.pix_fmt": "yuv420p",
        "video.is_depth_map": False, "video.fps": rate, "video.channels": 3, "has_audio": False,
    }  # fmt: skip
    info = {
        "codebase_version": VERSION,
        "robot_type": domains[0] if len(domains) == 1 else None,
        "total_episodes": len(episodes),
        "total_frames": sum(lengths),
        "total_tasks": len(tasks),
        "chunks_size": CHUNKS_SIZE,
        "data_files_size_in_mb": 100,
        "video_files_size_in_mb": 500,
        "fps": rate,
        "splits": {"train": f"0:{len(episodes)}"},
        "data_path": DATA_PATH,
        "video_path": VIDEO_PATH,
        "features": {
            "action": {"dtype": "float32", "shape": [width], "names": None},
            VIDEO_KEY: {"dtype": "video", "shape": [shape[0], shape[1], 3],
                        "names": ["height", "width", "channels"], "info": video_info},
            "timestamp": {"dtype": "float32", "shape": [1], "names": None},
            **{k: {"dtype": "int64", "shape": [1], "names": None}
               for k in INDEX_COLUMNS},
        },
    }  # fmt: skip
    (meta / "info.json").write_text(json.dumps(info, indent=4) + "\n")
    _write_tasks(meta / "tasks.parquet", tasks)
    _write_episodes(root, episodes, lengths, tasks, fps)
    stacked = np.concatenate(actions).astype(np.float64)
    stats = {"action": {"min": stacked.min(0).tolist(), "max": stacked.max(0).tolist(),
                        "mean": stacked.mean(0).tolist(), "std": stacked.std(0).tolist(),
                        "count": [len(stacked)]}}  # fmt: skip
    (meta / "stats.json").write_text(json.dumps(stats, indent=4) + "\n")


def _write_tasks(path: Path, tasks: list[str]) -> None:
    """Tasks keyed by their text, as LeRobot writes them with pandas (the task is the frame's index)."""
    table = pa.table({"task_index": pa.array(range(len(tasks)), pa.int64()), "task": pa.array(tasks)})
    pandas_meta = {
        "index_columns": ["task"],
        "column_indexes": [],
        "columns": [
            {"name": "task_index", "field_name": "task_index", "pandas_type": "int64", "numpy_type": "int64",
             "metadata": None},
            {"name": "task", "field_name": "task", "pandas_type": "unicode", "numpy_type": "object",
             "metadata": None},
        ],
        "creator": {"library": "pyarrow", "version": pa.__version__},
        "pandas_version": "2.0.0",
    }  # fmt: skip
    pq.write_table(table.replace_schema_metadata({"pandas": json.dumps(pandas_meta)}), path)


def _write_episodes(root: Path, episodes: list[Output], lengths: list[int], tasks: list[str], fps) -> None:
    starts = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    video = f"videos/{VIDEO_KEY}"
    columns = {
        "episode_index": list(range(len(episodes))),
        "tasks": [[o.record["request"]["prompt"]] for o in episodes],
        "length": lengths,
        "data/chunk_index": [_location(n // EPISODES_PER_DATA_FILE)[0] for n in range(len(episodes))],
        "data/file_index": [_location(n // EPISODES_PER_DATA_FILE)[1] for n in range(len(episodes))],
        "dataset_from_index": starts[:-1],
        "dataset_to_index": starts[1:],
        f"{video}/chunk_index": [_location(n)[0] for n in range(len(episodes))],
        f"{video}/file_index": [_location(n)[1] for n in range(len(episodes))],
        f"{video}/from_timestamp": [0.0] * len(episodes),
        f"{video}/to_timestamp": [int(o.record["request"]["num_frames"]) / fps for o in episodes],
        "meta/episodes/chunk_index": [0] * len(episodes),
        "meta/episodes/file_index": [0] * len(episodes),
        "cosmos3/request_id": [o.id for o in episodes],
    }
    path = root / EPISODES_PATH.format(chunk_index=0, file_index=0)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path)
