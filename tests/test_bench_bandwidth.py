"""Bandwidth accounting of a decode step (kvbench.bench.bandwidth) and the decode benchmarks' step statistics
(kvbench.bench.clock.step_rate), on hand-made numbers and tiny models; nothing here is timed against a bound."""
from __future__ import annotations

import pytest
import torch
import transformers

from kvbench.bench import bandwidth, clock
from kvbench.compress.accounting import StoredBytes


def test_step_rate_is_the_median_step_and_its_2_5_97_5_percentiles():
    r = clock.step_rate([float(t) for t in range(40, 0, -1)])          # 1..40 ms, any order
    assert r["median_ms"] == 20.5 and r["tokens_per_s"] == 1000 / 20.5
    # inclusive interpolation: the 2.5th percentile of 1..40 is 1 + 0.025 x 39
    assert r["tps_hi95"] == pytest.approx(1000 / (1 + 0.025 * 39))
    assert r["tps_lo95"] == pytest.approx(1000 / (40 - 0.025 * 39))
    assert clock.step_rate([4.0]) == {"tokens_per_s": 250.0, "tps_lo95": 250.0, "tps_hi95": 250.0, "median_ms": 4.0}
    with pytest.raises(ValueError, match="at least one step time"):
        clock.step_rate([])
    with pytest.raises(ValueError, match=r"step times must be positive ms, got \[0.0\]"):
        clock.step_rate([1.0, 0.0])


def _tiny(arch: str) -> torch.nn.Module:
    common = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 100}
    if arch == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, tie_word_embeddings=False))
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, tie_word_embeddings=True))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_weight_bytes_count_one_embedding_row_and_the_whole_head(arch):
    model = _tiny(arch)
    emb = 100 * 32 * 4                                                  # vocab x hidden, float32
    unique = sum(p.numel() for p in model.parameters()) * 4             # a tied head is one tensor
    # untied (Llama): the embedding matrix is replaced by one row, the head is already counted;
    # tied (Qwen2): the one shared matrix is read in full by the head, plus one row by the lookup
    expected = unique - emb + 32 * 4 + (emb if arch == "qwen2" else 0)
    assert bandwidth.weight_bytes(model) == expected
    assert bandwidth.weight_bytes(model.to(torch.bfloat16)) == expected // 2


def test_estimate_reads_raw_parts_held_and_coded_parts_by_compute_ratio():
    kv_width, seen = 2 * 2 * 8, 100                                     # 2 KV heads of 8: K and V values per token
    exact = StoredBytes(layer=0, full_layer=2 * kv_width * seen)        # the exact store, counted FP16
    # held in float32: twice the packed FP16 bytes, every token read
    assert bandwidth.estimate_layer_read(exact, attended=100, visible=100, seen=seen, kv_width=kv_width,
                                         element_size=4) == 4 * kv_width * seen
    kivi = StoredBytes(layer=1, full_layer=1000)                        # a quantised full layer: read as packed
    assert bandwidth.estimate_layer_read(kivi, attended=100, visible=100, seen=seen, kv_width=kv_width,
                                         element_size=4) == 1000
    sparse = StoredBytes(layer=2, codes=400, scales=100, indices=200, references=300, raw_window=64, sinks=16)
    # raw window and sinks in full (x 2 held in float32), the coded parts at CR 0.25
    assert bandwidth.estimate_layer_read(sparse, attended=25, visible=100, seen=seen, kv_width=kv_width,
                                         element_size=4) == 2 * 80 + 0.25 * 1000
    with pytest.raises(ValueError, match="attended must be in .*got attended=101, visible=100"):
        bandwidth.estimate_layer_read(sparse, attended=101, visible=100, seen=seen, kv_width=kv_width, element_size=4)


class _Audited:
    def __init__(self, n: int):
        self.n = n

    def read_bytes(self) -> int:
        return self.n


class _Plain:
    seen = 10

    def stored_bytes(self) -> StoredBytes:
        return StoredBytes(layer=0, full_layer=2 * 4 * 10)


class _Cache:
    def __init__(self, layers):
        self.layers, self.attended = layers, [[10] * len(layers)]


def test_press_read_bytes_prefers_each_layer_s_audit():
    assert bandwidth.press_read_bytes(_Cache([_Audited(7), _Audited(5)]), 10, 4, 2) == (12, "audit")
    # one layer without an audit makes the whole count an estimate: exact FP16 store held in bf16 = as packed
    assert bandwidth.press_read_bytes(_Cache([_Audited(7), _Plain()]), 10, 4, 2) == (7 + 80, "estimate")
    empty = _Cache([_Plain()])
    empty.attended = []
    with pytest.raises(ValueError, match="recorded no forward"):
        bandwidth.press_read_bytes(empty, 10, 4, 2)


def test_step_columns_and_peaks(monkeypatch):
    cols = bandwidth.step_columns(3_000_000, 1_000_000, "estimate", 2.0, 10.0, None)
    assert list(cols) == bandwidth.COLUMNS
    assert cols["bytes_per_step"] == 4_000_000 and cols["achieved_gb_s"] == pytest.approx(2.0)   # 4 MB in 2 ms
    assert cols["share_of_measured_bw"] == pytest.approx(0.2) and cols["share_of_peak"] is None
    assert bandwidth.step_columns(4_000_000, 0, "audit", 2.0, 10.0, 4.0)["share_of_peak"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="median_ms and machine_gb_s must be > 0"):
        bandwidth.step_columns(1, 1, "audit", 0.0, 10.0, None)
    assert bandwidth.peak_gb_s("cpu") is None
    for name, peak in [("NVIDIA H200", 4800.0), ("NVIDIA H100 80GB HBM3", 3350.0), ("NVIDIA H100 PCIe", 2000.0),
                       ("NVIDIA A100-SXM4-80GB", 2039.0), ("NVIDIA A100-SXM4-40GB", 1555.0), ("NVIDIA L4", None)]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        assert bandwidth.peak_gb_s("cuda:0") == peak, name


def test_copy_benchmark_and_tensor_bytes():
    assert bandwidth.copy_gb_s("cpu", mib=1, repeats=2, warmup=0) > 0
    with pytest.raises(ValueError, match="mib=0"):
        bandwidth.copy_gb_s("cpu", mib=0)
    assert bandwidth.tensor_bytes([torch.zeros(3, 4), None, torch.zeros(2, dtype=torch.bfloat16)]) == 48 + 4
