"""Train the demo model (DESIGN.md §16) on this machine's CPU, deterministically, and write it to
cosmos3_batch/model/trained_tiny/ with demo_model.json (command, timings, digests, held-out accuracy).

    python scripts/train_tiny.py            # the shipped model (see docs/demo-model.md for its time)
    python scripts/train_tiny.py --quick --out /tmp/demo   # a minute or two: checks the recipe runs
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cosmos3_batch.model.demo import evaluate, grammar, trained  # noqa: E402
from cosmos3_batch.model.demo.train_transformer import (  # noqa: E402
    TransformerRecipe,
    build_helper,
    grammar_tokenizer,
    make_examples,
    train_transformer,
)
from cosmos3_batch.model.demo.train_vae import VaeRecipe, encode_means, latent_statistics, train_vae  # noqa: E402
from cosmos3_batch.model.tiny import publish_folder, scheduler_config  # noqa: E402

log = logging.getLogger("cosmos3_batch.train_tiny")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=trained.SHIPPED)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vae-steps", type=int, default=VaeRecipe.steps)
    p.add_argument("--transformer-steps", type=int, default=TransformerRecipe.steps)
    p.add_argument("--image-variants", type=int, default=2, help="Jittered drawings per trained image scene.")
    p.add_argument("--video-variants", type=int, default=1, help="Jittered drawings per trained video scene.")
    p.add_argument("--video-stride", type=int, default=3, help="Encode every Nth trained video scene.")
    p.add_argument("--eval-scenes", type=int, default=16, help="Held-out scenes per kind to score (0: all).")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (the result depends on it).")
    p.add_argument("--quick", action="store_true", help="A tiny run that only checks the recipe works.")
    return p.parse_args()


def build_models(seed: int):
    from diffusers import AutoencoderKLWan, Cosmos3OmniTransformer, UniPCMultistepScheduler

    spec = trained.DEMO_SPEC
    # Module constructors draw their initial weights from torch's global generator: seed it before each.
    torch.manual_seed(seed)
    vae = AutoencoderKLWan(**trained.demo_vae_config(torch.Generator().manual_seed(seed)))
    scenes = [s for video in (False, True) for part in grammar.split_scenes(video=video) for s in part]
    tokenizer = grammar_tokenizer(vae, scenes)  # the tokenizer's size is the transformer's vocabulary
    torch.manual_seed(seed)
    transformer = Cosmos3OmniTransformer(**trained.demo_transformer_config(len(tokenizer)))
    scheduler = UniPCMultistepScheduler(**scheduler_config(spec))
    return transformer, vae, scheduler, tokenizer


def normalised(latents: list[torch.Tensor], mean: list[float], std: list[float]) -> list[torch.Tensor]:
    m, s = torch.tensor(mean).view(1, -1, 1, 1, 1), torch.tensor(std).view(1, -1, 1, 1, 1)
    return [(z - m) / s for z in latents]


def train(args: argparse.Namespace, models) -> dict[str, float]:
    transformer, vae, scheduler, tokenizer = models
    images, _ = grammar.split_scenes(video=False)
    videos, _ = grammar.split_scenes(video=True)
    if args.quick:
        images, videos = images[::40], videos[::10]
    times = {}
    start = time.monotonic()
    vae_recipe = VaeRecipe(steps=args.vae_steps)
    train_vae(vae, images, videos, vae_recipe, seed=args.seed)
    times["vae_train_s"] = round(time.monotonic() - start, 1)
    image_latents, image_figures = encode_means(vae, images, args.image_variants, seed=args.seed + 1)
    # The colour, shape and background words are learned from the pictures too: a third of the trained clips
    # teach the motion words, and encoding a clip costs as much as nine pictures.
    videos = videos[:: args.video_stride]
    video_latents, video_figures = encode_means(vae, videos, args.video_variants, seed=args.seed + 2)
    log.info("encoded %d image and %d video latents", len(image_latents), len(video_latents))
    mean, std = latent_statistics(image_latents + video_latents)
    vae.register_to_config(latents_mean=mean, latents_std=std)
    times["vae_s"] = round(time.monotonic() - start, 1)
    start = time.monotonic()
    helper = build_helper(transformer, tokenizer, vae, scheduler)
    image_examples = make_examples(
        helper, images, normalised(image_latents, mean, std), image_figures, args.image_variants
    )
    video_examples = make_examples(
        helper, videos, normalised(video_latents, mean, std), video_figures, args.video_variants
    )
    recipe = TransformerRecipe(steps=args.transformer_steps)
    train_transformer(
        transformer, image_examples, video_examples, recipe, scheduler.config.flow_shift, args.seed
    )
    times["transformer_s"] = round(time.monotonic() - start, 1)
    log.info("recipes: %s %s", dataclasses.asdict(vae_recipe), dataclasses.asdict(recipe))
    return times


def held_out_accuracy(models, count: int) -> dict:
    transformer, vae, scheduler, tokenizer = models
    pipeline = build_helper(transformer, tokenizer, vae, scheduler)
    result = {}
    for kind, video in (("images", False), ("videos", True)):
        scenes = grammar.split_scenes(video=video)[1]
        scenes = grammar.spread(scenes, count) if count else scenes
        result[kind] = evaluate.evaluate(pipeline, scenes)[0].as_dict()
        log.info("held-out %s: %s", kind, result[kind])
    return result


def save(models, out: Path, record: dict) -> None:
    transformer, vae, scheduler, tokenizer = models
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    transformer.save_pretrained(tmp / "transformer", safe_serialization=True)
    vae.save_pretrained(tmp / "vae", safe_serialization=True)
    scheduler.save_pretrained(tmp / "scheduler")
    tokenizer.save_pretrained(tmp / "text_tokenizer")
    digests = trained.file_digests(tmp)
    record = {**record, "digest": trained.combined_digest(digests), "files": digests}
    (tmp / trained.RECORD).write_text(json.dumps(record, indent=2) + "\n")
    publish_folder(tmp, out)
    log.info("wrote %s (digest %s)", out, record["digest"])


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.quick:
        args.vae_steps, args.transformer_steps, args.eval_scenes = 4, 4, 1
        args.image_variants = 1
    # Same command, same bytes: fixed seeds, a fixed thread count (CPU GEMMs reduce in a thread-count
    # dependent order) and torch's deterministic kernels.
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    command = "python scripts/train_tiny.py " + shlex.join(sys.argv[1:])
    models = build_models(args.seed)
    times = train(args, models)
    accuracy = held_out_accuracy(models, args.eval_scenes)
    record = {
        "command": command.strip(),
        "torch": torch.__version__,
        "threads": args.threads,
        "train_seconds": times,
        "held_out_accuracy": accuracy,
        "eval": {"steps": evaluate.STEPS, "guidance": evaluate.GUIDANCE},
    }
    save(models, args.out, record)


if __name__ == "__main__":
    main()
