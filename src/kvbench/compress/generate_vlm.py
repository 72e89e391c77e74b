"""Greedy decoding of one VLM record (images + text) through a compressed cache (ResidualKV Table II).

The prompt is the one the full-model VLM eval builds (:func:`kvbench.models.prompting.model_inputs`:
:func:`kvbench.models.prompting.encode_record`, the processor's chat template with the generation prompt), so the
``fullkv`` press reproduces :class:`~kvbench.eval.methods.FullCache`. As for text records
(:mod:`kvbench.compress.generate`), the prompt is prefilled in one or two chunks by the press's ``protocol``: the
context chunk is everything before the question text (system prompt, images and their captions), the question
chunk the question and the template's tail; every image lies in the context chunk. Then greedy decoding, each
step reading the compressed cache.

Positions: the model's own (M-RoPE ``[3, 1, T]`` from ``model.model.get_rope_index`` for Qwen2.5-VL/Qwen3-VL,
``[1, T]`` otherwise), passed explicitly to every forward, so decode steps continue at ``max position + 1`` (the
model's ``rope_deltas``) without relying on the state the model keeps between calls. The cache's key positions,
which masking reads, stay sequence positions (:class:`~kvbench.compress.cache.PressCache`).

Visual tokens: before the prefill's first decoder layer runs, :attr:`PressCache.visual` is set to
:class:`~kvbench.compress.cache.VisualTokens` from the language model's input embeddings (captured by a
forward pre-hook on the text decoder, so the vision tower runs once, inside the model's own forward, with
everything it adds, e.g. Qwen3-VL's deepstack features).

Presses that re-rotate keys (ResidualKV and Palu invert RoPE on the keys they are given and rotate restored keys
at their positions, :class:`~kvbench.compress.cache.LayerContext`) read the cache's RoPE table by sequence position;
on an M-RoPE model :func:`new_vlm_cache` gives them :class:`MRopeTable`, which holds the model's 3-D rotation of each
sequence position, so their rotations are the model's own. Eviction presses store post-RoPE keys and never rotate.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch

from kvbench.compress.cache import Press, PressCache, RopeTable, VisualTokens, press_attention
from kvbench.models import rope
from kvbench.models.prompting import model_inputs, vlm_messages


def is_mrope(model: Any) -> bool:
    """Whether ``model``'s text decoder uses multimodal RoPE (``mrope_section`` in its rope parameters)."""
    cfg = model.config.get_text_config()
    for key in ("rope_parameters", "rope_scaling"):
        params = getattr(cfg, key, None)
        if isinstance(params, dict) and "mrope_section" in params:
            return True
    return False


class MRopeTable(RopeTable):
    """cos/sin of an M-RoPE model's rotary embedding, indexed by SEQUENCE position: the table a cache's layers read
    (:class:`~kvbench.compress.cache.RopeTable`, :meth:`LayerContext.rotate`/``unrotate``, ResidualKV's kernel path)
    maps sequence position p to the model's 3-D position of token p, so presses that restore pre-RoPE keys rotate
    them exactly as the model did: by the prompt's ``[3, 1, T]`` positions (images by (t, h, w)), then, for decode
    steps at p >= T, by ``max(prompt positions) + 1 + (p - T)`` on every axis (the model's ``rope_deltas``).

    Args:
        rotary_emb: the text decoder's rotary module; dtype: the model's dtype.
        prompt_positions: int64 ``[3, 1, T]``, :func:`prompt_positions`.
    """

    def __init__(self, rotary_emb: Any, dtype: torch.dtype, prompt_positions: torch.Tensor):
        super().__init__(rotary_emb, dtype)
        if prompt_positions.dim() != 3 or prompt_positions.shape[:2] != (3, 1):
            raise ValueError(f"prompt_positions must be int64 [3, 1, T], got {tuple(prompt_positions.shape)}")
        self.prompt = prompt_positions

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cap = 0 if self.cos is None else self.cos.shape[0]
        if cap < self.needed:
            cap = max(self.needed, 2 * cap)
            t = self.prompt.shape[-1]
            start = int(self.prompt.max()) + 1
            tail = torch.arange(start, start + max(0, cap - t), device=self.prompt.device).view(1, 1, -1).expand(3, 1, -1)
            pos = torch.cat([self.prompt[..., :cap], tail], -1)
            cos, sin = rope.cos_sin(self.rotary_emb, pos.to(positions.device), self.dtype)
            self.cos, self.sin = cos[0], sin[0]
        return self.cos.index_select(0, positions).unsqueeze(0), self.sin.index_select(0, positions).unsqueeze(0)


def new_vlm_cache(press: Press, model: Any, positions: torch.Tensor) -> PressCache:
    """``press``'s empty cache for ``model``; on an M-RoPE model its layers share an :class:`MRopeTable` over the
    prompt's ``positions`` (:func:`prompt_positions`) instead of the 1-D table."""
    cache = press.new_cache(model)
    if positions.dim() == 3:
        first = cache.layers[0].ctx
        table = MRopeTable(first.rotary_emb, first.dtype, positions)
        for layer in cache.layers:
            layer.ctx.rope = table
    return cache


def encode_vlm(model: Any, proc: Any, record: dict, base_dir: Any) -> dict:
    """The full VLM eval's prompt tensors (:func:`kvbench.models.prompting.model_inputs`) on the model's device:
    ``input_ids`` int64 ``[1, T]``, ``pixel_values`` (model dtype), ``image_grid_thw``, ``mm_token_type_ids``."""
    inputs, _ = model_inputs(model, proc, record, base_dir)
    inputs.pop("attention_mask", None)  # the press attention masks by key positions
    return inputs


def question_start(proc: Any, record: dict, input_ids: torch.Tensor) -> int:
    """Index of the first question token in ``input_ids`` ``[1, T]`` (the prompt of :func:`encode_vlm`).

    The rendered prompt's tail from the question text on (question + the template's closing and generation
    prompt) holds no image, so it is tokenised alone and matched against the end of ``input_ids``; a token that
    straddles the boundary belongs to the context chunk (as :func:`kvbench.compress.generate.split_prompt`).

    Raises:
        ValueError: the question text is not in the rendered prompt.
    """
    text = proc.apply_chat_template(vlm_messages(record), tokenize=False, add_generation_prompt=True)
    at = text.rfind(record["question"])
    if not record["question"] or at < 0:
        raise ValueError(f"record {record.get('id')!r}: question {record['question']!r} not found in its rendered prompt")
    tok = getattr(proc, "tokenizer", proc)
    tail = tok(text[at:], add_special_tokens=False)["input_ids"]
    ids = input_ids[0].tolist()
    n = 0
    while n < min(len(tail), len(ids)) and tail[-1 - n] == ids[-1 - n]:
        n += 1
    return len(ids) - n


def prompt_positions(model: Any, inputs: dict) -> torch.Tensor:
    """The model's position ids of the prompt: int64 ``[3, 1, T]`` (M-RoPE: ``model.model.get_rope_index``) or
    ``[1, T]``."""
    ids = inputs["input_ids"]
    if is_mrope(model):
        grids = {k: inputs[k] for k in ("image_grid_thw", "video_grid_thw") if k in inputs}
        if "mm_token_type_ids" not in inputs or not grids:
            return torch.arange(ids.shape[1], device=ids.device).view(1, 1, -1).expand(3, 1, -1)
        pos, _ = model.model.get_rope_index(ids, inputs["mm_token_type_ids"], **grids)
        return pos
    return torch.arange(ids.shape[1], device=ids.device).view(1, -1)


def visual_positions(model: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """int64 ``[n_vis]``: ascending positions of the image/video placeholder tokens in ``input_ids`` ``[1, T]``."""
    ids = {getattr(model.config, k, None) for k in ("image_token_id", "video_token_id")} - {None}
    mask = torch.zeros_like(input_ids[0], dtype=torch.bool)
    for i in ids:
        mask |= input_ids[0] == int(i)
    return mask.nonzero().flatten()


def merged_grids(model: Any, inputs: dict, n_vis: int) -> list[tuple[int, int, int]]:
    """Per image ``(t, h, w)`` of merged patches (``image_grid_thw`` // the spatial merge size), in prompt order;
    ``[]`` when the model has no grid (LLaVA-style) or the grids do not cover ``n_vis`` tokens (images and videos
    mixed)."""
    merge = getattr(getattr(model.config, "vision_config", None), "spatial_merge_size", None)
    thw = [inputs[k] for k in ("image_grid_thw", "video_grid_thw") if k in inputs]
    if merge is None or len(thw) != 1:
        return []
    grids = [(int(t), int(h) // merge, int(w) // merge) for t, h, w in thw[0].tolist()]
    return grids if sum(t * h * w for t, h, w in grids) == n_vis else []


def _vision_tower(model: Any) -> Any:
    """The vision encoder sub-model (Qwen ``visual``, LLaVA ``vision_tower``), or None."""
    inner = getattr(model, "model", model)
    for name in ("visual", "vision_tower", "vision_model"):
        tower = getattr(inner, name, None)
        if tower is not None and hasattr(tower, "set_attn_implementation"):
            return tower
    return None


@torch.inference_mode()
def greedy_generate_vlm(model: Any, press: Press, inputs: dict, split: int, max_new_tokens: int,
                        eos: set[int]) -> tuple[list[int], PressCache]:
    """Prefill ``inputs`` (:func:`encode_vlm`) in chunks ``[:split]`` and ``[split:]`` through ``press``'s cache
    (0 or T: one chunk), with :attr:`PressCache.visual` set, then decode greedily (module docstring).

    Returns:
        ``(new_ids, cache)``, as :func:`kvbench.compress.generate.greedy_generate`.

    Raises:
        ValueError: a visual token after ``split`` (the context chunk must hold every image), or a press with a
            context pass (KVzip: :attr:`~kvbench.compress.cache.Press.context_pass`).
    """
    out: list[int] = []
    with _prefilled(model, press, inputs, split) as (cache, logits, step_position):
        for _ in range(max_new_tokens):
            nxt = int(logits[0, -1].argmax())
            out.append(nxt)
            if nxt in eos or len(out) == max_new_tokens:
                break
            logits = step_position(nxt)
    return out, cache


@torch.inference_mode()
def continuation_logprob_vlm(model: Any, press: Press, inputs: dict, split: int,
                             continuation: list[int]) -> tuple[float, bool, PressCache]:
    """Log-likelihood of ``continuation`` after the prompt, read through ``press``'s compressed cache (lmms-eval's
    ``loglikelihood`` contract, multiple-choice tasks).

    The prompt is prefilled as :func:`greedy_generate_vlm` prefills it; then the continuation is teacher-forced one
    token per decode step, so its tokens enter the cache as generated tokens do (a press that compresses while
    decoding acts on them) and each is scored by the logits of the step before it, as a generated token would be.

    Args:
        continuation: token ids (>= 1).

    Returns:
        ``(sum of log-probabilities in nats, whether every token is the greedy argmax, cache)``.

    Raises:
        ValueError: an empty continuation; the errors of :func:`greedy_generate_vlm`.
    """
    if not continuation:
        raise ValueError("continuation must have at least one token")
    total, greedy = 0.0, True
    with _prefilled(model, press, inputs, split) as (cache, logits, step_position):
        for i, t in enumerate(continuation):
            lp = torch.log_softmax(logits[0, -1].float(), -1)
            total += float(lp[t])
            greedy = greedy and int(lp.argmax()) == t
            if i + 1 < len(continuation):
                logits = step_position(t)
    return total, greedy, cache


@contextmanager
def _prefilled(model: Any, press: Press, inputs: dict, split: int):
    """Prefill ``inputs`` through ``press``'s cache (:func:`greedy_generate_vlm`'s chunks); yields ``(cache, last
    prefill logits [1, t, V], step)``, where ``step(token_id)`` forwards one decode step at the next position and
    returns its logits. Decode steps must run inside the block (the press's attention is installed there)."""
    if press.context_pass:
        # its scoring pass re-reads the context from token ids, where a VLM's image tokens are placeholders
        raise ValueError(f"press {press.name!r} scores the context by re-reading its token ids, which cannot carry "
                         "a VLM's images; it runs on text records only")
    ids = inputs["input_ids"]
    n = ids.shape[1]
    vis = visual_positions(model, ids)
    first = split if 0 < split < n else n
    if len(vis) and int(vis[-1]) >= first:
        raise ValueError(f"visual token at position {int(vis[-1])} lies after the context chunk (ends at {first}); "
                         "every image must precede the question")
    pos = prompt_positions(model, inputs)
    grids = merged_grids(model, inputs, len(vis))
    cache = new_vlm_cache(press, model, pos)
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model

    def capture(_module, args, kwargs):
        embeds = kwargs.get("inputs_embeds")
        if cache.visual is None and len(vis) and embeds is not None:
            cache.visual = VisualTokens(vis.to(torch.int64), embeds[0, vis.to(embeds.device)], grids)

    handle = decoder.register_forward_pre_hook(capture, with_kwargs=True)
    chunks = [(0, first)] + ([(first, n)] if first < n else [])
    vision = _vision_tower(model)
    vision_impl = None if vision is None else vision.config._attn_implementation
    next_position = [int(pos.max()) + 1]

    def step(token: int) -> torch.Tensor:
        p = torch.full(pos.shape[:-1] + (1,), next_position[0], dtype=pos.dtype, device=pos.device)
        next_position[0] += 1
        return model(input_ids=torch.tensor([[token]], device=ids.device), position_ids=p, cache=cache,
                     use_cache=True).logits

    try:
        with press_attention(model, cache):
            if vision is not None:
                # press_attention switches every sub-model; the vision tower's attention is not the cache's
                vision.set_attn_implementation(vision_impl)
            for i, (a, b) in enumerate(chunks):
                extra = {k: v for k, v in inputs.items() if k != "input_ids" and k != "mm_token_type_ids"} if i == 0 else {}
                if "mm_token_type_ids" in inputs:
                    extra["mm_token_type_ids"] = inputs["mm_token_type_ids"][:, a:b]
                logits = model(input_ids=ids[:, a:b], position_ids=pos[..., a:b], cache=cache, use_cache=True,
                               **extra).logits
                if i == 0 and len(chunks) > 1:
                    press.after_context(model, cache, ids[:, a:b])
            yield cache, logits, step
    finally:
        handle.remove()
