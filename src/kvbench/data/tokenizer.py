"""Offline byte-level BPE tokenizer and chat template for the tiny zoo.

No hub files exist here, so the zoo's tokenizer is trained by the project with
`tokenizers` on real text bundled with Python (the standard library source)
plus the task lexicon (:mod:`kvbench.data.lexicon`), and wrapped as a
``PreTrainedTokenizerFast`` saved with ``save_pretrained`` so it loads like any
checkpoint's tokenizer. Special tokens and the chat template follow Qwen2-VL's
names (``<|im_start|>``, ``<|vision_start|><|image_pad|><|vision_end|>``) so the
real ``Qwen2_5_VLProcessor`` can drive it. It lives with the data it is trained on, and the smoke
tasks measure their lengths in its tokens (:func:`kvbench.data.smoke.materialise`).
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)
from transformers import PreTrainedTokenizerFast
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

from kvbench.data import corpus, lexicon

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

#: Qwen2-VL-style chat template (images as vision_start/image_pad/vision_end).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _corpus(max_chars: int) -> list[str]:
    lines: list[str] = []
    total = 0
    for _, text in corpus.stdlib_files("train"):
        lines.append(text)
        total += len(text)
        if total >= max_chars:
            break
    lines.extend(lexicon.tokenizer_corpus_lines())
    return lines


def build_tokenizer(vocab_size: int = 4096, max_chars: int = 3_000_000) -> PreTrainedTokenizerFast:
    """Train the zoo tokenizer (deterministic for a given stdlib).

    Args:
        vocab_size: BPE vocabulary size including special tokens.
        max_chars: characters of stdlib (train pool) source to train on.

    Returns:
        A ``PreTrainedTokenizerFast`` with ``eos_token="<|im_end|>"``,
        ``pad_token="<|endoftext|>"`` and the chat template set.

    Raises:
        ValueError: ``vocab_size`` too small to hold the bytes, specials and lexicon.
    """
    min_size = 256 + len(SPECIAL_TOKENS) + lexicon.N_KEYS + lexicon.N_VALUES
    if vocab_size < min_size + 256:
        raise ValueError(f"vocab_size must be >= {min_size + 256} to hold the lexicon as single tokens, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    # Exactly Qwen2's normaliser and pre-tokeniser (digits split one by one):
    # AutoTokenizer rebuilds a checkpoint whose config says qwen2 as a
    # Qwen2Tokenizer with this pipeline, so any other choice would tokenise
    # differently once saved beside the model (tests/test_models.py).
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(max_chars), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        extra_special_tokens={
            "image_token": "<|image_pad|>",
            "video_token": "<|video_pad|>",
            "vision_start_token": "<|vision_start|>",
            "vision_end_token": "<|vision_end|>",
        },
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 32768
    return fast


def save_tokenizer(out_dir: str | Path, vocab_size: int = 4096) -> dict:
    """Build and ``save_pretrained`` the tokenizer into ``out_dir``; returns its summary.

    The summary records the vocabulary size, how many lexicon entries are
    single tokens and a SHA-256 of ``tokenizer.json`` (the stdlib version
    decides the merges, so the hash makes a changed interpreter visible).
    """
    out_dir = Path(out_dir)
    tok = build_tokenizer(vocab_size)
    tok.save_pretrained(out_dir)
    single = [w for w in lexicon.key_codes() + lexicon.value_codes() if len(tok.encode(" " + w)) == 1]
    return {
        "vocab_size": len(tok),
        "lexicon_single_tokens": len(single),
        "lexicon_size": lexicon.N_KEYS + lexicon.N_VALUES,
        "sha256": hashlib.sha256((out_dir / "tokenizer.json").read_bytes()).hexdigest(),
    }


def load_tokenizer_dir(tokenizer_dir: str | Path) -> PreTrainedTokenizerFast:
    """The tokenizer saved in ``tokenizer_dir`` (by :func:`save_tokenizer` or ``save_pretrained``), offline.

    Raises:
        FileNotFoundError: the directory is missing, or holds no ``tokenizer.json`` (an empty or partial
            directory), naming it and how to build one.
    """
    from transformers import AutoTokenizer

    path = Path(tokenizer_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer directory {str(tokenizer_dir)!r} not found; build it with `kvbench tokenizer`")
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"tokenizer directory {str(tokenizer_dir)!r} holds no tokenizer.json (empty or "
                                f"partial); rebuild it with `kvbench tokenizer`")
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
