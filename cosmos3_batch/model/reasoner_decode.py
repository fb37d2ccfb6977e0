"""One reasoner sequence, token by token, as `generate` runs it at batch 1 (modules: model/reasoner.py).

A sequence holds its own K/V per layer (a transformers `DynamicCache`), its token ids so far, its logits
processors and its own generator. Each pass it brings the tokens in flight (the prompt at prefill, then one
token) through every layer it is handed, in layer order, and after the last one picks the next token. The
steps are `generate`'s: the prompt's embeddings with the vision features scattered in, 3D positions from the
model's own `_prepare_position_ids_for_generation` (each step: the last + 1), the causal mask from
`create_causal_mask`, the deepstack adds after the first layers, the final norm, `lm_head` on the last row
only (`logits_to_keep=1`), the logits in float32 through `_get_logits_processor`'s list, then argmax or
`multinomial` (drawn from the request's generator, where `generate` draws from torch's global one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cosmos3_batch.model.reasoner import PresencePenalty, Prompt, Reasoner


def build_prompt(reasoner: Reasoner, embed, chat: list[dict], extra: dict | None = None) -> Prompt:
    """The processor's inputs for `chat` (its own chat template; `extra`: a video's metadata and sampling
    fps), embedded; the ViT runs here, once."""
    inputs = reasoner.processor.apply_chat_template(
        chat,
        tokenize=True,
        add_generation_prompt=True,
        return_dict=True,
        return_tensors="pt",
        processor_kwargs=extra or None,
    )
    model, device = reasoner.omni.model, reasoner.device
    input_ids = inputs["input_ids"]
    embeds = embed(input_ids[0]).unsqueeze(0)
    prompt = Prompt(input_ids=input_ids, embeds=embeds, position_ids=None)
    for kind, pixels, grid in (
        ("image", "pixel_values", "image_grid_thw"),
        ("video", "pixel_values_videos", "video_grid_thw"),
    ):
        if pixels not in inputs:
            continue
        features = getattr(model, f"get_{kind}_features")(
            inputs[pixels].to(device), inputs[grid].to(device), return_dict=True
        )
        vision = torch.cat(features.pooler_output, dim=0).to(embeds.device, embeds.dtype)
        masks = model.get_placeholder_mask(
            input_ids.to(device), inputs_embeds=embeds, **{f"{kind}_features": vision}
        )
        mask = masks[0] if kind == "image" else masks[1]
        prompt.embeds = prompt.embeds.masked_scatter(mask, vision)
        prompt.visual_mask = mask[..., 0]
        prompt.deepstack = [torch.cat(feat, dim=0) for feat in features.deepstack_features]
        prompt.vision_tokens = int(vision.shape[0])
    kwargs = {
        key: inputs[key]
        for key in ("attention_mask", "mm_token_type_ids", "image_grid_thw", "video_grid_thw")
        if key in inputs
    }
    kwargs["input_ids"] = input_ids
    prompt.position_ids = reasoner.omni._prepare_position_ids_for_generation(input_ids, kwargs).to(device)
    return prompt


@dataclass
class ReasonSeq:
    """A sequence's decoding state; `hidden` is what the next layer of this pass reads."""

    prompt_length: int
    ids: torch.Tensor  # [1, tokens so far]: the processors read them (repetition penalty)
    hidden: torch.Tensor  # [1, tokens in flight, hidden]
    position_ids: torch.Tensor  # [4, 1, tokens in flight]
    processors: object
    generator: torch.Generator
    do_sample: bool
    eos: frozenset[int]
    max_new_tokens: int
    cache: object = None
    visual_mask: torch.Tensor | None = None
    deepstack: list[torch.Tensor] = field(default_factory=list)
    next_layer: int = 0  # the layer the tokens in flight reach next; num_layers when through the stack
    mask: object = None
    rotary: tuple | None = None
    generated: list[int] = field(default_factory=list)
    stop_reason: str | None = None  # "eos" or "max_new_tokens" once ended


def start(reasoner: Reasoner, prompt: Prompt, spec, seed: int) -> ReasonSeq:
    """A sequence at its prefill, with `generate`'s generation config and logits processors for `spec`."""
    from transformers import DynamicCache, LogitsProcessorList

    omni, device = reasoner.omni, reasoner.device
    config, _ = omni._prepare_generation_config(None, **spec.generate_kwargs())
    omni._prepare_special_tokens(config, True, device=device)
    n = prompt.input_ids.shape[1]
    extra = LogitsProcessorList([PresencePenalty(spec.presence_penalty, n)] if spec.presence_penalty else [])
    processors = omni._get_logits_processor(
        generation_config=config,
        input_ids_seq_length=n,
        encoder_input_ids=prompt.input_ids,
        prefix_allowed_tokens_fn=None,
        logits_processor=extra,
        device=device,
        model_kwargs={},
    )
    eos = config.eos_token_id
    eos = frozenset([eos] if isinstance(eos, int) else (eos or []))
    return ReasonSeq(
        prompt_length=n,
        ids=prompt.input_ids.to(device),
        hidden=prompt.embeds,
        position_ids=prompt.position_ids,
        processors=processors,
        generator=torch.Generator(device).manual_seed(seed),
        do_sample=bool(config.do_sample),
        eos=eos,
        max_new_tokens=int(config.max_new_tokens),
        cache=DynamicCache(config=reasoner.text_config),
        visual_mask=prompt.visual_mask,
        deepstack=prompt.deepstack,
    )


def begin(reasoner: Reasoner, seq: ReasonSeq) -> None:
    """Before layer 0 of a pass: the causal mask and rotary embeddings of the tokens in flight."""
    from transformers.masking_utils import create_causal_mask

    seq.mask = create_causal_mask(
        config=reasoner.text_config,
        inputs_embeds=seq.hidden,
        attention_mask=None,  # `generate` drops an all-ones mask
        cache=seq.cache,
        position_ids=seq.position_ids[0],
    )
    seq.rotary = reasoner.rotary(seq.hidden, seq.position_ids[1:])
    seq.next_layer = 0


def apply_layer(reasoner: Reasoner, seq: ReasonSeq, layer: torch.nn.Module, index: int) -> None:
    """The tokens in flight through decoder layer `index` (already pointed at its UND part)."""
    if seq.next_layer != index:  # already through it (prefilled ahead of its admission), or ended
        return
    seq.hidden = layer(
        seq.hidden,
        attention_mask=seq.mask,
        position_ids=seq.position_ids[0],
        cache=seq.cache,
        position_embeddings=seq.rotary,
    )
    if index < len(seq.deepstack):  # the ViT's early features, added at the vision tokens (prefill only)
        hidden = seq.hidden.clone()
        mask = seq.visual_mask.to(hidden.device)
        hidden[mask, :] = hidden[mask, :] + seq.deepstack[index].to(hidden.device, hidden.dtype)
        seq.hidden = hidden
    seq.next_layer = index + 1


def next_token(reasoner: Reasoner, seq: ReasonSeq, embed) -> torch.Tensor:
    """After the last layer: the next token (a device tensor [1]); the sequence's inputs for the next pass."""
    normed = reasoner.norm(seq.hidden)
    logits = reasoner.lm_head(normed[:, -1:, :])
    scores = seq.processors(seq.ids, logits[:, -1].to(copy=True, dtype=torch.float32))
    if seq.do_sample:
        probs = torch.nn.functional.softmax(scores, dim=-1)
        token = torch.multinomial(probs, num_samples=1, generator=seq.generator).squeeze(1)
    else:
        token = torch.argmax(scores, dim=-1)
    seq.ids = torch.cat([seq.ids, token[:, None]], dim=-1)
    seq.position_ids = seq.position_ids[..., -1:] + 1
    seq.hidden = embed(token).unsqueeze(0)
    seq.deepstack, seq.visual_mask = [], None
    seq.next_layer = 0  # the new token starts at layer 0 on the next pass
    return token


def stop_check(seq: ReasonSeq, token: int) -> bool:
    """The host's read of the token just drawn (the pass's one sync for this sequence): EOS or the budget."""
    seq.generated.append(token)
    if token in seq.eos:
        seq.stop_reason = "eos"
    elif len(seq.generated) >= seq.max_new_tokens:
        seq.stop_reason = "max_new_tokens"
    return seq.stop_reason is not None
