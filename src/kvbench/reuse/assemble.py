"""Request assembly: the serving prefix + cached images at their new positions + the question (CONDUIT §3.1).

The serving request is encoded exactly as a full prefill would encode it
(:func:`kvbench.models.prompting.encode_record`, the processor's own chat
template with ``system``), so token ids and positions are those of the real
request. Image spans are found from the processor's token types (token spans,
never by searching for a separator string). Each span receives one cached
image: its vision features become the layer-0 inputs, and its pre-RoPE keys
are rotated to the span's new positions with the model's own rotary module
(1-D RoPE or Qwen2.5-VL's 3-axis M-RoPE; :mod:`kvbench.models.rope`).
Text tokens have no cached state: they are always computed.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvbench.models import rope
from kvbench.models.prompting import encode_record
from kvbench.reuse.adapter import VLMAdapter
from kvbench.reuse.cache_store import ImageKV, ImageKVStore


@dataclass
class AssembledRequest:
    """One serving request ready for the scoring pass and the executor (batch size 1, length T).

    Attributes:
        input_ids: int64 ``[1, T]``.
        position_ids: int64 ``[3, 1, T]`` (M-RoPE) or ``[1, T]``.
        cos, sin: ``[1, T, head_dim]`` (model dtype), RoPE at ``position_ids``.
        embeds: ``[1, T, hidden]`` layer-0 inputs (token embeddings; cached vision features at visual tokens).
        stale_k, stale_v: per layer ``[1, n_kv_heads, T, head_dim]``: cached K (rotated to the new
            positions) and V at visual tokens; zeros at text tokens, or the text K/V an in-place scoring pass
            wrote there (never read as stale entries: text is computed at every layer).
        visual_index: int64 ``[N_visual]`` sequence indices of visual tokens, ascending.
        image_of_visual: int64 ``[N_visual]`` image number (0..K-1) of each visual token.
        image_spans: ``[(start, end)]`` per image (sequence indices, end exclusive).
        text_index: int64 sequence indices of text tokens.
        query_index: int64 sequence indices after the last visual token (the trailing text the
            scoring pass reads with: question plus any template suffix; authors' ``tail_text``).
        next_position: position of the first generated token (max position + 1).
        enc: the processor output of the full request (for the full-prefill reference).
        images: the cached entries, in prompt order.
        consumed: True once an in-place refresh wrote visual rows into ``stale_k``/``stale_v``
            (:func:`kvbench.reuse.executor.execute`); such a request is refused by later runs.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    embeds: torch.Tensor
    stale_k: list[torch.Tensor]
    stale_v: list[torch.Tensor]
    visual_index: torch.Tensor
    image_of_visual: torch.Tensor
    image_spans: list[tuple[int, int]]
    text_index: torch.Tensor
    query_index: torch.Tensor
    next_position: int
    enc: dict = field(repr=False)
    images: list[ImageKV] = field(repr=False)
    consumed: bool = False

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    @property
    def n_visual(self) -> int:
        return self.visual_index.numel()

    @property
    def n_images(self) -> int:
        return len(self.image_spans)


def image_spans(mask: torch.Tensor) -> list[tuple[int, int]]:
    """Contiguous runs of True in a bool ``[T]`` mask, as ``(start, end)``."""
    spans, i = [], 0
    for val, grp in itertools.groupby(mask.tolist()):
        n = len(list(grp))
        if val:
            spans.append((i, i + n))
        i += n
    return spans


@torch.no_grad()
def assemble(adapter: VLMAdapter, record: dict, images: list[ImageKV],
             base_dir: str | Path | None = None, system_key: str = "system") -> AssembledRequest:
    """Assemble ``record`` served under ``record[system_key]`` from cached ``images``.

    Raises:
        ValueError: the record has no image, or the number/size of image spans in
            the encoded request differs from ``images`` (e.g. a cache built with
            another image processor).
    """
    n_img_parts = sum(1 for p in record.get("content", []) if p.get("type") == "image")
    if n_img_parts == 0:
        raise ValueError(f"record {record.get('id')!r} has no image part; the reuse engine needs >= 1 image")
    rec = dict(record)
    rec["system"] = record[system_key]
    enc = encode_record(rec, adapter.processor, base_dir)
    enc = {k: v.to(adapter.device) if torch.is_tensor(v) else v for k, v in enc.items()}
    mask = adapter.image_token_mask(enc)
    spans = image_spans(mask)
    if len(spans) != len(images):
        raise ValueError(f"request has {len(spans)} image spans but {len(images)} cached images were given")
    grids = enc.get("image_grid_thw")
    for j, ((s, e), im) in enumerate(zip(spans, images)):
        if e - s != im.n_tokens:
            raise ValueError(f"image {j}: request span has {e - s} visual tokens, cache entry {im.key[:12]} has "
                             f"{im.n_tokens} (built with another image processor?)")
        if grids is not None and im.grid_thw is not None and tuple(grids[j].tolist()) != tuple(im.grid_thw):
            raise ValueError(f"image {j}: grid_thw {grids[j].tolist()} differs from cache entry {im.grid_thw}")

    input_ids = enc["input_ids"]
    T = input_ids.shape[1]
    position_ids = adapter.position_ids(enc)
    cos, sin = adapter.cos_sin(position_ids)
    embeds = adapter.decoder.embed_tokens(input_ids).clone()
    for (s, e), im in zip(spans, images):
        embeds[0, s:e] = im.embeds.to(embeds.dtype)
    stale_k, stale_v = [], []
    for layer in range(adapter.n_layers):
        k = torch.zeros(1, adapter.n_kv_heads, T, adapter.head_dim, dtype=adapter.dtype, device=adapter.device)
        v = torch.zeros_like(k)
        for (s, e), im in zip(spans, images):
            # pre-RoPE cached keys rotated to the serving positions s..e (all 3 M-RoPE axes at once)
            k[:, :, s:e] = rope.rotate(adapter.apply_rope, im.keys[layer][None].to(k.dtype), cos[:, s:e], sin[:, s:e])
            v[:, :, s:e] = im.values[layer][None].to(v.dtype)
        stale_k.append(k)
        stale_v.append(v)
    visual_index = torch.cat([torch.arange(s, e) for s, e in spans]).to(adapter.device)
    image_of_visual = torch.cat([torch.full((e - s,), j) for j, (s, e) in enumerate(spans)]).to(adapter.device)
    text_index = (~mask).nonzero().flatten()
    query_index = torch.arange(spans[-1][1], T, device=adapter.device)
    return AssembledRequest(
        input_ids=input_ids, position_ids=position_ids, cos=cos, sin=sin, embeds=embeds,
        stale_k=stale_k, stale_v=stale_v, visual_index=visual_index, image_of_visual=image_of_visual,
        image_spans=spans, text_index=text_index, query_index=query_index,
        next_position=int(position_ids.max()) + 1, enc=enc, images=list(images))


def prepare(adapter: VLMAdapter, store: ImageKVStore, record: dict,
            base_dir: str | Path | None = None) -> AssembledRequest:
    """Look up (or build) the record's image caches in ``store`` and assemble the serving request.

    Raises:
        ValueError: the record has no image (checked before any cache work).
    """
    if not any(p.get("type") == "image" for p in record.get("content", [])):
        raise ValueError(f"record {record.get('id')!r} has no image part; the reuse engine needs >= 1 image")
    return assemble(adapter, record, store.entries(record, base_dir), base_dir)
