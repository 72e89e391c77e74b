"""Random-weight VLMs for timing only (CONDUIT Table 3 on the smoke profile).

The trained zoo VLM (``tiny-qwen2.5-vl``, d=128, 6 layers) is so small that a
prefill is dominated by Python and kernel-launch overhead, not by the matmuls a
refresh policy saves. Latency is therefore measured on a *wider* model of the
same class, ``Qwen2_5_VLForConditionalGeneration``, built in memory with
**random weights** (never trained, never saved): TTFT and FLOPs depend on the
shapes and on which tokens are computed, not on the weights, while answers of
this model are meaningless. Tables that use it say so in their header.

Only the text decoder is widened; the vision tower stays the zoo's (2 blocks,
width 64) with its output projected to the new width. Reuse methods never run
the vision tower (they start from the cached vision features), so its cost
appears only in full prefill and is reported separately there.
"""
from __future__ import annotations

from typing import Any

import torch
import transformers

from kvbench.models.tiny import build_config, build_processor

#: Text-decoder shapes of the timing models (Qwen2.5-VL-3B for comparison: d=2048, 36 layers,
#: 16 query / 2 KV heads of 128, MLP 11008, M-RoPE sections [16, 24, 24]).
TIMING_MODELS: dict[str, dict[str, Any]] = {
    "timing-qwen2.5-vl-wide": dict(
        hidden_size=1024, intermediate_size=2048, num_hidden_layers=12,
        num_attention_heads=8, num_key_value_heads=2, head_dim=128,
        max_position_embeddings=32768, initializer_range=0.02, mrope_section=[16, 24, 24],
    ),
    # Qwen2.5-VL-3B's text decoder exactly (the paper's latency backbone), for a GPU: 3.1B parameters, 12 GB in
    # float32, so not for the CPU. scripts/gpu_table3.sh times it at 4k/8k/16k.
    "timing-qwen2.5-vl-3b": dict(
        hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
        num_attention_heads=16, num_key_value_heads=2, head_dim=128,
        max_position_embeddings=32768, initializer_range=0.02, mrope_section=[16, 24, 24],
    ),
    # A small variant for unit tests of the benchmark code (fast, still the real class).
    "timing-qwen2.5-vl-test": dict(
        hidden_size=128, intermediate_size=256, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=8192, initializer_range=0.02, mrope_section=[4, 6, 6],
    ),
}


#: Qwen2.5-VL-3B-Instruct's config.json beyond the text-decoder shapes of ``timing-qwen2.5-vl-3b``: its vision
#: tower (the timing model keeps the zoo's) and the text fields that change no timing shape. For random-weight
#: checkpoints of the real architecture (:mod:`kvbench.gpu.paper`); the special-token ids stay the
#: tokenizer's (the zoo's), so its 151,936-row embedding table is larger than the vocabulary.
QWEN2_5_VL_3B_CHECKPOINT: dict[str, Any] = {
    "vision": dict(depth=32, hidden_size=1280, out_hidden_size=2048, intermediate_size=3420, num_heads=16,
                   in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                   fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2, hidden_act="silu"),
    "text": dict(vocab_size=151936, max_position_embeddings=128000, rms_norm_eps=1e-6, rope_theta=1000000.0,
                 hidden_act="silu", tie_word_embeddings=True),
}


def timing_config(name: str, tokenizer: Any) -> transformers.Qwen2_5_VLConfig:
    """The config of timing model ``name``: the zoo VLM's config with the text decoder replaced.

    Raises:
        KeyError: unknown name (the message lists :data:`TIMING_MODELS`).
    """
    if name not in TIMING_MODELS:
        raise KeyError(f"unknown timing model {name!r}; expected one of {sorted(TIMING_MODELS)}")
    spec = dict(TIMING_MODELS[name])
    section = spec.pop("mrope_section")
    if 2 * sum(section) != spec["head_dim"]:
        raise ValueError(f"{name}: mrope_section {section} must sum to head_dim/2 = {spec['head_dim'] // 2}")
    d = build_config("tiny-qwen2.5-vl", tokenizer).to_dict()
    text = d["text_config"]
    text.pop("layer_types", None)  # derived from num_hidden_layers; rebuilt by the config class
    text.update(spec)
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": list(section)}
    d["vision_config"]["out_hidden_size"] = spec["hidden_size"]
    cfg = transformers.Qwen2_5_VLConfig.from_dict(d)
    cfg.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    return cfg


def build_timing_vlm(name: str, tokenizer: Any, device: str | torch.device = "cpu",
                     dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[Any, Any]:
    """``(model, processor)``: timing model ``name`` with random weights (seeded), in eval mode on ``device``.

    The processor is the zoo VLM's (one visual token per 28x28 px, at most 256 per image).
    Attention runs through sdpa, as in the zoo.
    """
    cfg = timing_config(name, tokenizer)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):   # built where it runs: a 3B model's random init on a GPU takes seconds, not minutes
        model = transformers.Qwen2_5_VLForConditionalGeneration(cfg)
    model = model.to(dtype=dtype).eval()
    return model, build_processor(tokenizer)


def n_params(model: torch.nn.Module, prefix: str = "") -> int:
    """Number of parameters whose name starts with ``prefix``."""
    return sum(p.numel() for n, p in model.named_parameters() if n.startswith(prefix))
