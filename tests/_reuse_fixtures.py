"""Helpers for the reuse-engine tests: tiny random-weight VLMs and in-memory multi-image records."""
from __future__ import annotations

import numpy as np
import torch
import transformers
from PIL import Image


def random_image(seed: int, h: int = 56, w: int = 84) -> Image.Image:
    """Random RGB image; at the zoo's 28 px per visual token, 56x84 gives 2x3 = 6 visual tokens."""
    arr = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    return Image.fromarray(arr, "RGB")


def record(seeds: list[int], system: str = "Report the digit plus one.", question: str = "Page 1, cell A",
           generic: str = "You are a helpful assistant.", rid: str = "r0") -> dict:
    """A VLM record with one page per seed, each preceded by a ``Page k:`` text part."""
    content = []
    for k, s in enumerate(seeds, 1):
        content += [{"type": "text", "text": f"Page {k}:"}, {"type": "image", "image": random_image(s)}]
    return {"id": rid, "kind": "vlm", "system": system, "generic_system": generic, "content": content,
            "question": question, "answer": "1", "max_new_tokens": 1}


def tiny_vlm(tokenizer, seed: int = 0, **text_overrides):
    """(model, processor) of a random-weight ``tiny-qwen2.5-vl`` in eval mode."""
    from kvbench.models.tiny import build_config, build_processor

    cfg = build_config("tiny-qwen2.5-vl", tokenizer)
    for k, v in text_overrides.items():
        setattr(cfg.text_config, k, v)
    if "num_hidden_layers" in text_overrides and getattr(cfg.text_config, "layer_types", None):
        cfg.text_config.layer_types = cfg.text_config.layer_types[: text_overrides["num_hidden_layers"]]
    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    return model, build_processor(tokenizer)


def tiny_llava(tokenizer, seed: int = 0):
    """(model, processor) of a random-weight ``LlavaForConditionalGeneration``: a 2-layer CLIP vision tower
    (28 px images, 14 px patches: 4 visual tokens per image) and a 3-layer Qwen2 language model with
    1-D RoPE and GQA 4/2. The image placeholder is the zoo tokenizer's ``<|image_pad|>``."""
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        Qwen2Config,
    )

    from kvbench.models.tiny import VLM_CHAT_TEMPLATE

    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    vc = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                          image_size=28, patch_size=14, projection_dim=32)
    tc = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=512)
    cfg = LlavaConfig(vision_config=vc, text_config=tc, image_token_id=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
                      vision_feature_layer=-1, vision_feature_select_strategy="default", image_seq_length=4)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(cfg).eval()
    proc = LlavaProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 28},
                                                             crop_size={"height": 28, "width": 28}),
                          tokenizer=tokenizer, patch_size=14, vision_feature_select_strategy="default",
                          chat_template=VLM_CHAT_TEMPLATE, image_token="<|image_pad|>", num_additional_image_tokens=1)
    return model, proc


def prepared_request(adapter, cache_dir, seeds: list[int], **record_kw):
    """A request over random pages ``seeds``, its images cached in ``cache_dir`` then assembled."""
    from kvbench.reuse import ImageKVStore, prepare

    rec = record(seeds, **record_kw)
    return prepare(adapter, ImageKVStore(cache_dir, adapter, rec["generic_system"]), rec)
