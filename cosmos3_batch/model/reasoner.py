"""The reasoner (DESIGN.md §21) over transformers' `Cosmos3OmniForConditionalGeneration`, whose layers are the
UND halves the engine serves.

As the generator's modules come from diffusers, the reasoner's come from transformers: the model is built on
the meta device for its structure and its own methods (3D rotary positions, generation config, logits
processors), its Qwen3-VL decoder layers run with their parameters pointed at the UND part of whatever layer
the caller hands in (a slot view, or a resident layer), its ViT is loaded for real from the checkpoint's flat
keys, and `norm` and `lm_head` are the transformer file's own. Every op is the op `generate` runs, on the
same tensors and rows, so token ids equal `generate`'s on CPU float32 (tests/unit/test_reasoner_fidelity.py).
Nothing here knows about ranks or offload.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from cosmos3_batch.checkpoint.folder import Checkpoint
from cosmos3_batch.checkpoint.reasoner_parts import vision_files

# Our (diffusers) names of a layer's UND parameters -> the Qwen3-VL decoder layer's (the conversion table's).
RENAMES = {
    "self_attn.to_q.": "self_attn.q_proj.",
    "self_attn.to_k.": "self_attn.k_proj.",
    "self_attn.to_v.": "self_attn.v_proj.",
    "self_attn.to_out.": "self_attn.o_proj.",
    "self_attn.norm_q.": "self_attn.q_norm.",
    "self_attn.norm_k.": "self_attn.k_norm.",
}


def qwen_name(name: str) -> str:
    for ours, theirs in RENAMES.items():
        if name.startswith(ours):
            return theirs + name[len(ours) :]
    return name


def point(target: torch.nn.Module, names: list[tuple[str, str]], source: torch.nn.Module) -> None:
    """Set each (target name, source name) parameter of `target` to the source layer's tensor: no copy."""
    for theirs, ours in names:
        path, _, leaf = theirs.rpartition(".")
        src_path, _, src_leaf = ours.rpartition(".")
        owner = target.get_submodule(path)
        owner._parameters[leaf] = getattr(source.get_submodule(src_path), src_leaf)


class PresencePenalty:
    """`presence_penalty` (NVIDIA's reasoner mode, vLLM's meaning): subtracted once from the score of every
    token already generated. transformers has no such processor; `generate` takes this one as
    `logits_processor=[PresencePenalty(...)]`, after its own (where `generate` puts custom processors)."""

    def __init__(self, penalty: float, prompt_length: int):
        self.penalty, self.prompt_length = penalty, prompt_length

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        generated = input_ids[:, self.prompt_length :]
        seen = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, generated, True)
        return scores - self.penalty * seen.to(scores.dtype)


@dataclass
class Prompt:
    """One request's prompt as the model's forward sees it at prefill."""

    input_ids: torch.Tensor  # [1, n]
    embeds: torch.Tensor  # [1, n, hidden]: token embeddings with the vision features scattered in
    position_ids: torch.Tensor  # [4, 1, n]: text positions, then the 3 mRoPE rows
    visual_mask: torch.Tensor | None = None  # [1, n] bool: the vision tokens (deepstack adds there)
    deepstack: list[torch.Tensor] = field(default_factory=list)  # per early layer: [vision tokens, hidden]
    vision_tokens: int = 0


def load_processor(root: Path):
    """The checkpoint's Qwen3-VL processor (tokenizer, image processor; the video processor where torchvision
    is installed), with its chat template: what `AutoProcessor.from_pretrained(root)` builds."""
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen3VLProcessor

    class Processor(Qwen3VLProcessor):
        def check_argument_for_proper_class(self, name, argument):
            if argument is not None:  # no torchvision: no video processor, whose class check cannot run
                return super().check_argument_for_proper_class(name, argument)

    tokenizer = AutoTokenizer.from_pretrained(root)
    video = None
    try:
        from transformers import AutoVideoProcessor

        video = AutoVideoProcessor.from_pretrained(root)
    except (ImportError, OSError, ValueError):
        video = None  # documented in docs/reasoner.md: video requests fail alone without it
    image = AutoImageProcessor.from_pretrained(root)
    return Processor(image, tokenizer, video, chat_template=tokenizer.chat_template)


def messages(prompt: str, system: str | None, image=None, video=None) -> list[dict]:
    """The chat NVIDIA's reasoner mode sends: an optional system message, then the user's vision and text."""
    content: list[dict] = []
    if image is not None:
        content.append({"type": "image", "image": image})
    if video is not None:
        content.append({"type": "video", "video": video})
    content.append({"type": "text", "text": prompt})
    chat = [{"role": "system", "content": [{"type": "text", "text": system}]}] if system is not None else []
    return [*chat, {"role": "user", "content": content}]


class Reasoner:
    """The reasoner's modules for one process: built once, its decoder layers pointed per layer and pass."""

    def __init__(self, checkpoint: Checkpoint, transformer: torch.nn.Module, device: torch.device):
        from transformers import Cosmos3OmniConfig, Cosmos3OmniForConditionalGeneration, GenerationConfig
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

        root = checkpoint.root
        self.device = device
        self.dtype = getattr(transformer, "compute_dtype", transformer.embed_tokens.weight.dtype)
        self.config = Cosmos3OmniConfig.from_pretrained(root)
        with torch.device("meta"):
            self.omni = Cosmos3OmniForConditionalGeneration(self.config)
        if (root / "generation_config.json").is_file():
            self.omni.generation_config = GenerationConfig.from_pretrained(root)
        text = self.omni.model.language_model
        self.layers = text.layers
        self.text_config = text.config
        self.rotary = Qwen3VLTextRotaryEmbedding(self.text_config).to(device)
        self.norm = text.norm
        self.norm._parameters["weight"] = transformer.norm.weight
        store = checkpoint.store("transformer")
        self.lm_head = self.omni.lm_head
        self.lm_head._parameters["weight"] = store.tensor("lm_head.weight").to(
            device=device, dtype=self.dtype
        )
        self.omni.model.visual = self._load_vit(root)
        self.processor = load_processor(root)
        self.names: list[list[tuple[str, str]]] = []  # per layer: (Qwen3-VL name, ours) of its UND half
        self.bytes_resident = self.lm_head.weight.nbytes + sum(p.nbytes for p in self.visual.parameters())

    @property
    def visual(self) -> torch.nn.Module:
        return self.omni.model.visual

    def _load_vit(self, root: Path) -> torch.nn.Module:
        """The ViT, resident: it runs once per request, at admission (small beside the UND half)."""
        from safetensors.torch import load_file
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

        with torch.random.fork_rng(devices=[]):  # built for real (its buffers), then given the stored weights
            vit = Qwen3VLVisionModel(self.config.vision_config)
        tensors = {}
        for file, keys in vision_files(root).items():
            stored = load_file(root / file)
            tensors.update({key: stored[key] for key in keys})
        vit.load_state_dict(tensors, strict=True)
        return vit.to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)

    def point_layer(self, index: int, layer: torch.nn.Module) -> torch.nn.Module:
        """The Qwen3-VL decoder layer `index`, its parameters the given layer's UND tensors (no copy)."""
        if not self.names:
            from cosmos3_batch.model.cosmos3 import UND, part_of

            for _ in self.layers:
                names = [n for n, _ in layer.named_parameters() if part_of(n) == UND]
                self.names.append(
                    [(qwen_name(n), n) for n in names if not n.startswith("self_attn.k_norm_und")]
                )
        target = self.layers[index]
        point(target, self.names[index], layer)
        return target
