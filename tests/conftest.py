"""Shared fixtures: the zoo tokenizer (built once per session) and random-weight zoo checkpoints.

The suite runs on two pytest-xdist workers (``addopts`` in pyproject.toml): each worker computes on one intra-op
thread, so the two share the machine's two cores instead of oversubscribing them, and the long end-to-end tests
(marked ``slow``) are handed out first, so that they run beside the short ones instead of after them.
"""
from __future__ import annotations

import os

# OpenMP threads that find their core taken sleep instead of spinning: with two workers on two cores, a job of the
# end-to-end run that computes on 2 threads beside the other worker took 530 s instead of 146 s with the spin-wait
# (measured on one test with one core held busy). Scheduling only: no number changes. Inherited by the subprocesses.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Slow tests first (a stable sort: the rest keep their order), so a worker starts each long one early."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    """Directory of the zoo tokenizer, built offline once per test session (~15 s)."""
    from kvbench.data.tokenizer import save_tokenizer

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


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module (``pytestmark = pytest.mark.usefixtures("one_thread")``): the machine's
    2 cores are shared and tiny tensors gain nothing from more threads."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def tiny_lm():
    """A tiny random ``Qwen2ForCausalLM`` (3 layers, 4 query / 2 KV heads of 16, vocab 256), float32, eval:
    the compressed-cache tests' model."""
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=16, intermediate_size=128, vocab_size=256, attn_implementation="sdpa")
    return transformers.Qwen2ForCausalLM(cfg).eval()
