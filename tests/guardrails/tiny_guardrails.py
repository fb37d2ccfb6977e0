"""Tiny guardrail models of cosmos-guardrail's own classes, written into a scratch Hugging Face cache (nothing
is downloaded): `nvidia/Cosmos-1.0-Guardrail` (a blocklist of a few words per list, NLTK's data from Debian's
`wordnet-base`, RetinaFace with random weights) and `Qwen/Qwen3Guard-Gen-0.6B` (a small random
Qwen3ForCausalLM with a chat template). Facts behind the choices: ../shared/notes/guardrails-offline.md.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from cosmos3_batch.checkpoint.guardrail_cache import GUARDRAIL_REPO, QWEN3GUARD_REPO

BLOCKED_WORD = "zorblax"  # a fuzzy (better-profanity) blocklist word
EXACT_WORD = "quibbleflux"  # a whole-word (exact_match) one
WHITELISTED = "classic"  # whitelisted: a blocklist word inside it must not block
WORDNET = Path("/usr/share/wordnet")  # Debian's wordnet-base (scripts/env.sh guardrails installs it)
# WordNet 3.0's lexnames (the lexicographer files), which wordnet-base lacks: its rows as lexnames(5WN) lists.
LEXNAMES = (
    "adj.all 3 adj.pert 3 adv.all 4 noun.Tops 1 noun.act 1 noun.animal 1 noun.artifact 1 noun.attribute 1 "
    "noun.body 1 noun.cognition 1 noun.communication 1 noun.event 1 noun.feeling 1 noun.food 1 noun.group 1 "
    "noun.location 1 noun.motive 1 noun.object 1 noun.person 1 noun.phenomenon 1 noun.plant 1 "
    "noun.possession 1 noun.process 1 noun.quantity 1 noun.relation 1 noun.shape 1 noun.state 1 "
    "noun.substance 1 noun.time 1 "
    "verb.body 2 verb.change 2 verb.cognition 2 verb.communication 2 verb.competition 2 verb.consumption 2 "
    "verb.contact 2 verb.creation 2 verb.emotion 2 verb.motion 2 verb.perception 2 verb.possession 2 "
    "verb.social 2 verb.stative 2 verb.weather 2 adj.ppl 3"
)
REVISION = "0" * 40


def snapshot(cache: Path, repo: str) -> Path:
    """The snapshot folder of `repo` at refs/main, as huggingface_hub lays a cache out."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / "main").write_text(REVISION)
    path = folder / "snapshots" / REVISION
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_blocklist(root: Path) -> None:
    lists = {"custom": [BLOCKED_WORD], "exact_match": [EXACT_WORD], "whitelist": [WHITELISTED]}
    for name, words in lists.items():
        (root / "blocklist" / name).mkdir(parents=True, exist_ok=True)
        (root / "blocklist" / name / "words.txt").write_text("\n".join(words) + "\n")
    nltk = root / "blocklist" / "nltk_data"
    wordnet = nltk / "corpora" / "wordnet"
    wordnet.mkdir(parents=True, exist_ok=True)
    for name in [*(f"{kind}.{pos}" for kind in ("data", "index") for pos in ("noun", "verb", "adj", "adv")),
                 *(f"{pos}.exc" for pos in ("noun", "verb", "adj", "adv"))]:  # fmt: skip
        shutil.copyfile(WORDNET / name, wordnet / name)
    shutil.copyfile(WORDNET / "index.sense", wordnet / "index.sense")  # wordnet-sense-index
    words = LEXNAMES.split()
    rows = zip(words[0::2], words[1::2], strict=True)
    (wordnet / "lexnames").write_text(
        "".join(f"{i:02d}\t{name}\t{pos}\n" for i, (name, pos) in enumerate(rows))
    )
    punkt = nltk / "tokenizers" / "punkt_tab" / "english"
    punkt.mkdir(parents=True, exist_ok=True)
    for name in ("collocations.tab", "sent_starters.txt", "abbrev_types.txt", "ortho_context.tab"):
        (punkt / name).write_text("")


def write_retinaface(root: Path, seed: int = 0) -> None:
    """Random RetinaFace weights; the box-regression head zeroed (every box is its prior, inside the frame)
    and the face class favoured, so that faces are found (and pixelated) on any frame."""
    from retinaface.data import cfg_re50
    from retinaface.models.retinaface import RetinaFace

    torch.manual_seed(seed)
    net = RetinaFace(cfg={**cfg_re50, "pretrain": False}, phase="test")
    with torch.no_grad():
        for head in net.BboxHead:
            head.conv1x1.weight.zero_()
            head.conv1x1.bias.zero_()
        for head in net.ClassHead:
            head.conv1x1.bias.copy_(torch.tensor([-4.0, 4.0]).repeat(head.conv1x1.bias.numel() // 2))
    (root / "face_blur_filter").mkdir(parents=True, exist_ok=True)
    torch.save(net.state_dict(), root / "face_blur_filter" / "Resnet50_Final.pth")


def write_qwen3guard(root: Path, seed: int = 0) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from cosmos3_batch.model.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(root)
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    shape.update(num_key_value_heads=1, head_dim=16, max_position_embeddings=512)
    ids = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    config = Qwen3Config(vocab_size=len(tokenizer), **shape, **ids)
    torch.manual_seed(seed)
    Qwen3ForCausalLM(config).save_pretrained(root)


def build_cache(cache: Path) -> Path:
    """Both guardrail repos in `cache` (an HF_HUB_CACHE); returns it."""
    guardrail = snapshot(cache, GUARDRAIL_REPO)
    write_blocklist(guardrail)
    write_retinaface(guardrail)
    write_qwen3guard(snapshot(cache, QWEN3GUARD_REPO))
    return cache
