"""The key quantity the ResidualKV codec codes, decided once per attention module for training and inference.

A decoder attention makes its keys as ``k_proj(x)`` ``[B, T, H_kv·D]``, then, in some architectures, a
per-head norm over ``D`` (Qwen3's ``k_norm``, an RMSNorm), then RoPE. The codec codes the ``k_proj``
output for every model class, so it sees the same tensor in the teacher/compressed passes of training
(``train.py``) and in the cache at inference (``cache.py``); after restore the norm (when there is one),
then RoPE at the token's own position, give the keys attention reads.

Why before the norm: it is what the authors code (Sparse-vLLM, ``src/deltakv/``). Their Qwen3 inference
attention (``modeling/qwen3/qwen3_with_compress_inference.py``, ``Qwen3AttnKVCompress.forward``; later
``modeling/hf_common.py``, ``build_inference_classes`` with ``use_qk_norm=True``) passes the raw
``k_proj``/``v_proj`` outputs to the compressed cache's ``update`` and applies ``k_norm`` to the keys it
returns, then RoPE at their positions; their training attention (``hf_common.py``,
``build_cluster_training_classes``, used by ``modeling/qwen3_training.py``) takes the MSE target
``buffer_raw_kv`` and the codec input from ``k_proj`` and applies ``k_norm`` to the reconstruction
(``_shape_qkv``) before RoPE. ``docs/decisions/residualkv.md``, "The key the codec sees".

For models without a key norm (Qwen2, Llama, Qwen2.5-VL's text model) the ``k_proj`` output is the
pre-RoPE key, which the cache recovers by inverting RoPE on the keys it is given (no hook needed).
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class CodecKeys:
    """Where the codec's K comes from in one attention module.

    Parameters:
        source: the module whose output the codec codes as K (``k_proj``: ``[B, T, H_kv·D]``, before any
            key norm and before RoPE).
        norm: the per-head key norm the attention applies between ``source`` and RoPE (Qwen3's ``k_norm``,
            over the last dim ``D`` of ``[..., H_kv, D]``), applied after restore; None when there is none.
    """

    source: nn.Module
    norm: nn.Module | None


def codec_keys(attn: nn.Module) -> CodecKeys:
    """The codec's key source and the key norm to apply after restore, for a HF attention module ``attn``.

    Raises:
        TypeError: ``attn`` has no ``k_proj`` (an architecture the codec does not support).
    """
    source = getattr(attn, "k_proj", None)
    if not isinstance(source, nn.Module):
        raise TypeError(f"{type(attn).__name__} has no k_proj: the ResidualKV codec cannot tell what its keys are")
    norm = getattr(attn, "k_norm", None)
    # some modelling files keep a k_norm attribute as Identity when the config disables it
    if norm is not None and isinstance(norm, nn.Identity):
        norm = None
    return CodecKeys(source, norm)
