"""Shared fixtures: the zoo tokenizer (built once per session) and random-weight zoo checkpoints."""
from __future__ import annotations

import pytest
import torch
import transformers


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    """Directory of the zoo tokenizer, built offline once per test session (~15 s)."""
    from kvbench.models.tokenizer import save_tokenizer

    out = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    return transformers.AutoTokenizer.from_pretrained(tokenizer_dir)


def _random_zoo_checkpoint(name: str, tokenizer, out_dir):
    from kvbench.models.loader import save_checkpoint
    from kvbench.models.tiny import build_config, build_processor, zoo_spec

    torch.manual_seed(0)
    cfg = build_config(name, tokenizer)
    model = getattr(transformers, cfg.architectures[0])(cfg)
    proc = build_processor(tokenizer) if zoo_spec(name).kind == "vlm" else tokenizer
    return save_checkpoint(model, proc, out_dir)


@pytest.fixture(scope="session")
def lm_dir(tokenizer, tmp_path_factory):
    """A random-weight ``tiny-qwen2-lm`` checkpoint directory."""
    return _random_zoo_checkpoint("tiny-qwen2-lm", tokenizer, tmp_path_factory.mktemp("zoo") / "tiny-qwen2-lm")


@pytest.fixture(scope="session")
def vlm_dir(tokenizer, tmp_path_factory):
    """A random-weight ``tiny-qwen2.5-vl`` checkpoint directory."""
    return _random_zoo_checkpoint("tiny-qwen2.5-vl", tokenizer, tmp_path_factory.mktemp("zoo") / "tiny-qwen2.5-vl")
