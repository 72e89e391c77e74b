"""Random-weight text LMs for timing only (ResidualKV Fig. 8, decode throughput vs context length).

The trained zoo LM (``tiny-qwen2-lm``, d=128, 8 layers, d_kv 128) is so small that a decode step is
dominated by Python and kernel-launch overhead, not by the KV reads and restores a compressed cache
saves. Decode throughput is therefore measured on a *wider* model of the same class,
``Qwen2ForCausalLM``, built in memory with **random weights** (never trained, never saved): the time of
a decode step depends on the shapes and on how many keys each layer reads and restores, not on the
weights, while the tokens it generates are meaningless. CSVs that use it say so in their header.
This mirrors :mod:`kvbench.bench.timing_model`, which does the same for the CONDUIT VLM.

:func:`full_layers_for` picks ResidualKV+OmniKV's full-attention layers in the pattern of the paper's
Table I (the first layers plus a few spread ones; Llama-3.1-8B: 0, 1, 2, 8, 18 of 32, 15.6%);
:func:`full_layers_of` gives a timing LM's own (the Llama-shaped one takes Table I's exactly).

``timing-llama-3.1-8b`` is Llama-3.1-8B's shape (``LlamaForCausalLM``, untied head, its 128,256-token
vocabulary) for a GPU (``scripts/gpu_fig8.sh``): 8.0B random parameters, 16 GB in bfloat16, too large for
the CPU runs.

torch and transformers are imported by the functions that build, not by the module, so the settings of the
profiling verbs (:mod:`kvbench.bench.settings`) can check a timing LM's name without them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    import transformers

#: Shapes of the timing LMs (Llama-3.1-8B for comparison: d=4096, 32 layers, 32 query / 8 KV heads of
#: 128, MLP 14336, d_kv 2048). Keys besides the config's: ``arch`` (``qwen2``, the default, or ``llama``),
#: ``vocab_size`` (fixed; else the zoo tokenizer's) and ``full_layers`` (else :func:`full_layers_for`).
TIMING_LMS: dict[str, dict[str, Any]] = {
    # KV-bound by design: d_kv = 2 * 2 * 128 = 512 per layer (Qwen2.5-7B: 1,024) on small weights
    # (2.9M per layer), so that CPU contexts of 1K-8K tokens hold 0.2-1.4x the weights in KV, the regime
    # of Llama-3.1-8B at the paper's 64K-900K tokens (0.6-8.5x); 12 layers and 4 query heads keep the
    # untimed prefill of 8K tokens under a minute on 2 CPU cores; positions up to 1M for a GPU.
    "timing-qwen2-lm-wide": {
        "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 12,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128,
        "max_position_embeddings": 1 << 20, "initializer_range": 0.02,
    },
    # A small variant for unit tests of the benchmark code (fast, still the real class); d_kv = 64.
    "timing-qwen2-lm-test": {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 1 << 16, "initializer_range": 0.02,
    },
    # Llama-3.1-8B's shapes (its config.json): untied head, no biases, rope_theta 5e5 (no llama3 rope scaling:
    # it changes no shape); full layers of Table I; positions to 1M for the paper's contexts.
    "timing-llama-3.1-8b": {
        "arch": "llama", "vocab_size": 128256, "full_layers": (0, 1, 2, 8, 18),
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "max_position_embeddings": 1 << 20, "initializer_range": 0.02, "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
    },
}
#: Llama-3.1-8B-Instruct's config.json fields that ``timing-llama-3.1-8b`` leaves out (they change no shape): the
#: llama3 RoPE frequency scaling and the 128K positions. For random-weight checkpoints of the real architecture
#: (:mod:`kvbench.gpu.paper`); the special-token ids stay the tokenizer's (the zoo's).
LLAMA_3_1_8B_CHECKPOINT: dict[str, Any] = {
    "max_position_embeddings": 131072, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": TIMING_LMS["timing-llama-3.1-8b"]["rope_theta"],
                        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192},
}
#: Keys of a :data:`TIMING_LMS` entry that are not config fields.
_META = ("arch", "vocab_size", "full_layers")

#: The zoo tokenizer whose vocabulary the timing LMs use (only its size matters: the LM head's width).
ZOO_TOKENIZER = "tiny-qwen2-lm"


def zoo_vocab_size(tokenizer: str = ZOO_TOKENIZER) -> int:
    """Vocabulary size of ``tokenizer``: a tokenizer or checkpoint directory, or a zoo name
    (:func:`kvbench.models.loader.resolve_spec`). The default also finds the zoo tokenizer alone
    (``zoo/<profile>/tokenizer-<hash>/``, built in seconds) when the zoo LM is not trained, since only the
    vocabulary size is needed.

    Raises:
        ValueError: nothing found, naming ``tokenizer`` and how to build or pass one.
    """
    import transformers

    from kvbench.models.loader import CheckpointError, resolve_spec, zoo_root

    try:
        path = resolve_spec(tokenizer)
    except CheckpointError as e:
        found = sorted({p.parent for p in zoo_root().glob("*/tokenizer-*/tokenizer.json")})
        # profiles with the same tokenizer recipe hold the same tokenizer under the same name
        if tokenizer != ZOO_TOKENIZER or len({p.name for p in found}) != 1:
            seen = f"; zoo tokenizers found: {', '.join(map(str, found))}" if found else ""
            raise ValueError(f"tokenizer {tokenizer!r}: {e}. A timing LM needs a tokenizer only for its vocabulary "
                             f"size: pass --tokenizer DIR (the zoo's is built in seconds by `snakemake "
                             f"zoo/smoke/tokenizer-<hash>/tokenizer.json`; `snakemake -n -p` prints the hash){seen}") from None
        path = found[0]
    tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    return len(tok)


def full_layers_for(n_layers: int) -> tuple[int, ...]:
    """ResidualKV+OmniKV full-attention layers of an ``n_layers`` model: 0, 1 and ``n_layers // 4``.

    The paper's Table I pattern (Llama-3.1-8B: 0, 1, 2, 8, 18 of 32; Qwen2.5-7B: 0, 1, 2, 4, 7, 14 of 28):
    the first layers dense, then few spread ones; (0, 1, 3) of 12 (25%) for the wide timing LM, (0, 1, 2) for
    the 8-layer zoo LM, (0, 1) for the 4-layer test LM, (0,) for 2 layers. Layer 1 and ``n_layers // 4`` are filter layers
    (a full layer followed by a sparse one).

    Raises:
        ValueError: ``n_layers < 2`` (no sparse layer would remain after a filter layer).
    """
    if n_layers < 2:
        raise ValueError(f"n_layers must be >= 2 for a filter layer followed by a sparse one, got {n_layers}")
    return (0,) if n_layers == 2 else tuple(sorted({0, 1, n_layers // 4}))


def full_layers_of(name: str) -> tuple[int, ...]:
    """Full-attention layers of timing LM ``name``: its own (``timing-llama-3.1-8b``: Table I's 0, 1, 2, 8, 18)
    or :func:`full_layers_for` its depth.

    Raises:
        KeyError: unknown name.
    """
    spec = _spec(name)
    return tuple(spec.get("full_layers") or full_layers_for(spec["num_hidden_layers"]))


def fixed_vocab_size(name: str) -> int | None:
    """The vocabulary size timing LM ``name`` fixes (``timing-llama-3.1-8b``: 128,256), or None (it takes the
    zoo tokenizer's, :func:`zoo_vocab_size`).

    Raises:
        KeyError: unknown name.
    """
    return _spec(name).get("vocab_size")


def timing_lm_config(name: str, vocab_size: int | None = None) -> transformers.PreTrainedConfig:
    """The config of timing LM ``name`` (``Qwen2Config``, tied head; or ``LlamaConfig``, untied) with sdpa
    attention and a ``vocab_size``-token head (None: the LM's fixed size).

    Raises:
        KeyError: unknown name (the message lists :data:`TIMING_LMS`).
        ValueError: ``vocab_size < 2``, or None for an LM without a fixed size.
    """
    import transformers

    spec = _spec(name)
    vocab_size = spec.get("vocab_size") if vocab_size is None else vocab_size
    if vocab_size is None or vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size} (timing LM {name!r} fixes none)")
    fields = {k: v for k, v in spec.items() if k not in _META}
    if spec.get("arch") == "llama":
        cfg = transformers.LlamaConfig(**fields, vocab_size=vocab_size, tie_word_embeddings=False,
                                       attn_implementation="sdpa")
        cfg.architectures = ["LlamaForCausalLM"]
    else:
        cfg = transformers.Qwen2Config(**fields, vocab_size=vocab_size, tie_word_embeddings=True,
                                       rope_theta=10000.0, attn_implementation="sdpa")
        cfg.architectures = ["Qwen2ForCausalLM"]
    return cfg


def build_timing_lm(name: str, vocab_size: int | None = None, device: str | torch.device = "cpu",
                    dtype: torch.dtype | None = None, seed: int = 0) -> Any:
    """Timing LM ``name`` with random weights (seeded), in eval mode on ``device``, in ``dtype`` (None:
    float32); ``vocab_size`` None: the LM's fixed size.

    The weights are drawn on ``device`` in ``dtype`` (an 8B model is never materialised in float32 on the
    host); on the CPU in float32 that is the same draw as building on the CPU and casting.

    Raises:
        KeyError: unknown name; ValueError: see :func:`timing_lm_config`.
    """
    import torch
    import transformers

    cfg = timing_lm_config(name, vocab_size)
    cls = transformers.LlamaForCausalLM if _spec(name).get("arch") == "llama" else transformers.Qwen2ForCausalLM
    dev, dt = torch.device(device), dtype or torch.float32
    old = torch.get_default_dtype()
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []), dev:
        torch.manual_seed(seed)
        torch.set_default_dtype(dt)
        try:
            model = cls(cfg)
        finally:
            torch.set_default_dtype(old)
    return model.to(device=dev, dtype=dt).eval()


def _spec(name: str) -> dict[str, Any]:
    if name not in TIMING_LMS:
        raise KeyError(f"unknown timing LM {name!r}; expected one of {sorted(TIMING_LMS)}")
    return TIMING_LMS[name]
