"""One object that knows where a VLM keeps the parts the reuse engine drives.

The engine runs the model's own decoder layers (so every refresh path uses the
exact attention, norm and MLP code of the checkpoint) but needs a handful of
architecture facts: the text decoder and its rotary module, the image
placeholder id, how the processor marks image tokens, how positions are
assigned, and how the vision tower is called. :class:`VLMAdapter` collects
them; :func:`adapter_for` picks the subclass for a model.

Supported: ``Qwen2_5_VLForConditionalGeneration`` (3-axis M-RoPE, positions
from ``model.model.get_rope_index``) and LLaVA-style models whose language
model uses 1-D RoPE (``LlavaForConditionalGeneration``), see
:class:`LlavaAdapter`.
"""
from __future__ import annotations

import abc
import hashlib
import json
from typing import Any

import torch
from torch import nn

from kvbench.models import rope


def _tokenizer(proc: Any) -> Any:
    return getattr(proc, "tokenizer", proc)


class VLMAdapter(abc.ABC):
    """Architecture facts and small helpers for one VLM (batch size 1 throughout).

    Attributes:
        model: the HF model (``eval()`` is the caller's job).
        processor: its processor (chat template, image processor, tokenizer).
        decoder: the text decoder module (``.layers``, ``.norm``, ``.embed_tokens``, ``.rotary_emb``).
        lm_head: output projection.
        image_token_id: id of the image placeholder token (one per visual token).
        n_layers, n_heads, n_kv_heads, head_dim: text-decoder shape.
        mrope: True when positions are ``[3, 1, T]`` (M-RoPE), False for ``[1, T]``.
    """

    mrope = False

    def __init__(self, model: nn.Module, processor: Any):
        self.model = model
        self.processor = processor
        self.decoder = self._decoder()
        self.layers = self.decoder.layers
        self.lm_head = model.lm_head
        tcfg = model.config.get_text_config()
        self.n_layers = len(self.layers)
        self.n_heads = tcfg.num_attention_heads
        self.n_kv_heads = tcfg.num_key_value_heads
        self.head_dim = getattr(tcfg, "head_dim", None) or tcfg.hidden_size // tcfg.num_attention_heads
        self.apply_rope = rope.rotation_fn(self.layers[0].self_attn)
        self.image_token_id = int(self._image_token_id())

    # --- architecture hooks (overridden per family) -------------------------------------------
    def _decoder(self) -> nn.Module:
        return self.model.model.language_model

    def _image_token_id(self) -> int:
        return self.model.config.image_token_id

    def position_ids(self, enc: dict) -> torch.Tensor:
        """int64 ``[1, T]`` positions 0..T-1 (1-D RoPE)."""
        return torch.arange(enc["input_ids"].shape[1], device=enc["input_ids"].device)[None]

    @abc.abstractmethod
    def image_features(self, enc: dict) -> list[torch.Tensor]:
        """Vision-tower output per image, each ``[n_j, hidden]`` in the model dtype (per family)."""

    def image_token_mask(self, enc: dict) -> torch.Tensor:
        """bool ``[T]``: True at visual tokens (the placeholders the vision features replace)."""
        return enc["input_ids"][0] == self.image_token_id

    # --- shared helpers -----------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.decoder.embed_tokens.weight.device

    def encode(self, messages: list[dict], images: list) -> dict:
        """Render ``messages`` with the processor's own chat template and encode them with ``images``.

        Returns the processor's tensors (``input_ids`` ``[1, T]`` and, where the
        processor makes them, ``pixel_values``, ``image_grid_thw``,
        ``mm_token_type_ids``) moved to the model's device.
        """
        text = self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        enc = self.processor(text=[text], images=images or None, return_tensors="pt")
        return {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in dict(enc).items()}

    def cos_sin(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[1, T, head_dim]`` from the decoder's own rotary module."""
        return rope.cos_sin(self.decoder.rotary_emb, position_ids, self.dtype)

    @torch.no_grad()
    def full_forward(self, enc: dict):
        """The model's own forward over ``enc`` (full prefill, ``use_cache=True``)."""
        keep = {k: v for k, v in enc.items() if k in ("input_ids", "pixel_values", "image_grid_thw",
                                                     "mm_token_type_ids", "attention_mask", "image_sizes")}
        return self.model(**keep, use_cache=True)

    def queries(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Post-RoPE queries ``[1, n_heads, n, head_dim]`` of layer ``layer`` for normed inputs ``x`` ``[1, n, d]``.

        Follows the attention module's own order: ``q_proj``, then ``q_norm``
        where the architecture has one (Qwen3), then RoPE.
        """
        attn = self.layers[layer].self_attn
        q = attn.q_proj(x).view(1, x.shape[1], -1, self.head_dim)
        if hasattr(attn, "q_norm"):
            q = attn.q_norm(q)
        q = q.transpose(1, 2)
        return rope.rotate(self.apply_rope, q, cos, sin)

    def fingerprint(self) -> str:
        """sha256 of the config (minus private/version keys) and every parameter's name, shape, dtype and bytes.

        Two checkpoints with the same config but different weights get different
        fingerprints, so their image caches never mix. Cost: one pass over the
        weights (about 10 s for 15 GB); cached on the adapter.
        """
        if getattr(self, "_fingerprint", None):
            return self._fingerprint
        cfg = {k: v for k, v in self.model.config.to_dict().items()
               if not k.startswith("_") and k != "transformers_version"}
        h = hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode())
        for name, t in sorted(self.model.state_dict().items()):
            t = t.detach().contiguous().cpu()
            h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        self._fingerprint = h.hexdigest()
        return self._fingerprint


class Qwen25VLAdapter(VLMAdapter):
    """``Qwen2_5_VLForConditionalGeneration``: M-RoPE positions from ``model.model.get_rope_index``.

    ``mm_token_type_ids`` (processor output) is required: without it
    transformers 5 silently falls back to 1-D positions (docs/decisions/zoo.md, "Prompt format").
    """

    mrope = True

    def position_ids(self, enc: dict) -> torch.Tensor:
        """int64 ``[3, 1, T]`` (temporal, height, width) positions.

        Raises:
            ValueError: ``enc`` lacks ``mm_token_type_ids``.
        """
        if "mm_token_type_ids" not in enc:
            raise ValueError("Qwen2.5-VL positions need mm_token_type_ids from the processor (M-RoPE)")
        if "image_grid_thw" not in enc:
            return super().position_ids(enc)[None].expand(3, 1, -1)
        pos, _ = self.model.model.get_rope_index(
            enc["input_ids"], enc["mm_token_type_ids"], image_grid_thw=enc["image_grid_thw"])
        return pos

    def image_features(self, enc: dict) -> list[torch.Tensor]:
        out = self.model.model.get_image_features(enc["pixel_values"], enc["image_grid_thw"], return_dict=True)
        return [t.to(self.dtype) for t in out.pooler_output]

    def image_token_mask(self, enc: dict) -> torch.Tensor:
        return enc["mm_token_type_ids"][0] == 1


class LlavaAdapter(VLMAdapter):
    """LLaVA-style models (vision tower + projector + a 1-D-RoPE language model)."""

    def image_features(self, enc: dict) -> list[torch.Tensor]:
        kw = {"image_sizes": enc["image_sizes"]} if "image_sizes" in enc else {}
        feats = self.model.model.get_image_features(
            pixel_values=enc["pixel_values"],
            vision_feature_layer=self.model.config.vision_feature_layer,
            vision_feature_select_strategy=self.model.config.vision_feature_select_strategy,
            **kw)
        feats = getattr(feats, "pooler_output", feats)
        return [f.reshape(-1, f.shape[-1]).to(self.dtype) for f in feats]


_ADAPTERS = {
    "Qwen2_5_VLForConditionalGeneration": Qwen25VLAdapter,
    "LlavaForConditionalGeneration": LlavaAdapter,
}


def adapter_for(model: nn.Module, processor: Any) -> VLMAdapter:
    """The adapter for ``model``'s class.

    Raises:
        ValueError: unsupported model class (the message lists the supported ones).
    """
    cls = _ADAPTERS.get(type(model).__name__)
    if cls is None:
        raise ValueError(f"no reuse adapter for {type(model).__name__}; supported: {sorted(_ADAPTERS)}")
    return cls(model, processor)
