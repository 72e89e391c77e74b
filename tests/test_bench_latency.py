"""CONDUIT Table 3 benchmark code: FLOP counting vs. the analytic count, the timing model, the clock and
the table builder. Runs on the small timing model (seconds); the real table is a pipeline target, not a test."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch

from kvbench.bench import TABLE3_METHODS, clock, flops
from kvbench.bench.cost import analytic_cost, visual_rows
from kvbench.bench.latency import (
    RAW_COLUMNS,
    LatencyConfig,
    measure_flops,
    run_conduit_latency,
    serve_cached,
    serve_full,
)
from kvbench.bench.requests import bench_record, visual_tokens_per_page
from kvbench.report.conduit.table3 import build_table3, write_table3
from kvbench.bench.timing_model import build_timing_vlm, timing_config
from kvbench.reuse import ImageKVStore, adapter_for, assemble, available_policies, refresh
from kvbench.reuse.policies.cacheblend import linear_layer_counts

torch.set_num_threads(1)
#: Stated tolerance of measured vs. analytic FLOPs (relative). They agree exactly on CPU today: every
#: counted op is a matmul/attention the analytic model lists, and RoPE/softmax/norms count 0 in both.
FLOPS_RTOL = 1e-3


@pytest.fixture(scope="module")
def adapter(tokenizer):
    return adapter_for(*build_timing_vlm("timing-qwen2.5-vl-test", tokenizer))


@pytest.fixture(scope="module")
def served(adapter, tmp_path_factory):
    rec = bench_record(2, 112)
    images = ImageKVStore(tmp_path_factory.mktemp("imgcache"), adapter, rec["generic_system"]).entries(rec)
    return rec, images


def test_timing_model_is_the_wide_real_class(tokenizer):
    cfg = timing_config("timing-qwen2.5-vl-wide", tokenizer)
    assert cfg.architectures == ["Qwen2_5_VLForConditionalGeneration"]
    assert cfg.text_config.hidden_size >= 1024 and cfg.text_config.num_hidden_layers > 6
    assert cfg.vision_config.out_hidden_size == cfg.text_config.hidden_size
    with pytest.raises(KeyError, match="timing-qwen2.5-vl-wide"):
        timing_config("nope", tokenizer)


def test_pages_set_the_context_size():
    rec = bench_record(3, 112)
    pages = [p["image"] for p in rec["content"] if p["type"] == "image"]
    assert len(pages) == 3 and all(p.size == (112, 112) for p in pages)
    assert visual_tokens_per_page(280) == 100
    with pytest.raises(ValueError, match="multiple of 28"):
        bench_record(2, 100)


def test_3b_timing_model_has_qwen25_vl_3b_text_shapes(tokenizer):
    """The GPU Table 3 model (scripts/gpu_table3.sh): Qwen2.5-VL-3B's decoder (d 2048, 36 layers, 16/2 heads of 128,
    MLP 11008), built on the meta device here (no memory): about 3.1B decoder parameters with the zoo vocabulary."""
    import transformers

    cfg = timing_config("timing-qwen2.5-vl-3b", tokenizer)
    t = cfg.text_config
    assert (t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads, t.intermediate_size) == \
        (2048, 36, 16, 2, 11008)
    with torch.device("meta"):
        model = transformers.Qwen2_5_VLForConditionalGeneration(cfg)
    layers = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n and "visual" not in n)
    assert 2.7e9 < layers < 2.8e9   # 36 x 77.1M: the 3B model's decoder layers (embeddings apart)


def test_requests_longer_than_a_docpages_record():
    """The paper's latency contexts need 16-64 pages; docpages has 24 field codes (6 pages). Bug: 16 pages raised
    "no field code for page 7"."""
    rec = bench_record(16, 56)
    pages = [p["image"] for p in rec["content"] if p["type"] == "image"]
    labels = [p["text"] for p in rec["content"] if p["type"] == "text"]
    assert len(pages) == 16 and labels == [f"Page {k}:" for k in range(1, 17)]
    assert len({p.tobytes() for p in pages}) == 16   # distinct pages: no image cache shared between spans
    assert rec["meta"]["page"] <= 6 and rec["question"] == bench_record(16, 56)["question"]


def test_layer_flops_formula_by_hand():
    s = flops.DecoderShape(n_layers=1, hidden=8, n_heads=2, n_kv_heads=1, head_dim=4, intermediate=16, vocab=10)
    # qkv 2*3*8*(2+2)*4=768, attn 2*2*3*5*2*4=480, out 2*3*2*4*8=384, mlp 2*3*3*8*16=2304
    assert flops.layer_flops(s, 3, 5) == 768 + 480 + 384 + 2304
    assert flops.full_prefill_flops(s, 5) == flops.layer_flops(s, 5, 5) + 2 * 8 * 10


@pytest.mark.parametrize("method", TABLE3_METHODS)
def test_measured_flops_match_analytic(adapter, served, method):
    rec, images = served
    f = measure_flops(adapter, rec, images, method, 0.1, flops.DecoderShape.of(adapter.model))
    decoder = f["flops"] - f["flops_vision"]
    assert decoder == pytest.approx(f["flops_analytic"], rel=FLOPS_RTOL)
    assert f["flops_scoring"] == pytest.approx(f["flops_analytic_scoring"], rel=FLOPS_RTOL)
    assert (f["flops_vision"] > 0) == (method == "full")  # only full prefill runs the vision tower
    assert (f["flops_scoring"] > 0) == (method in ("conduit", "prophetkv"))


def test_cpu_attention_is_counted():
    """Without kvbench's extra formula PyTorch counts CPU sdpa as 0 FLOPs."""
    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8)
    _, fc = flops.count_flops(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, k, enable_gqa=True))
    assert fc.total == 2 * 2 * 4 * 3 * 5 * 8


def test_analytic_rows_follow_the_executed_schedule(adapter, served):
    rec, images = served
    req = assemble(adapter, rec, images)
    L, N = adapter.n_layers, req.n_visual
    for policy in available_policies():  # every registered policy states its rows (RefreshPolicy.visual_rows)
        res = refresh(adapter, req, policy, 0.1)
        assert visual_rows(policy, req, 0.1, L) == res.output.layer_counts, policy
    assert visual_rows("kvshare-conduit", req, 0.1, L) == linear_layer_counts(L, N, -(-N // 10))
    full = analytic_cost("full", req, 0.1, flops.DecoderShape.of(adapter.model))
    assert full.scoring == 0 and full.total == flops.full_prefill_flops(flops.DecoderShape.of(adapter.model), req.seq_len)


def test_served_paths_give_the_first_token(adapter, served):
    rec, images = served
    s = serve_cached(adapter, rec, images, "conduit", 1.0)
    f = serve_full(adapter, rec)
    assert s.token == f.token  # r = 1 reproduces full prefill
    assert s.ttft_ms > s.assemble_ms > 0 and f.ttft_ms > 0


def test_summarise_quartiles():
    s = clock.summarise([5, 1, 3, 2, 4])
    assert (s["median"], s["q1"], s["q3"], s["min"], s["max"], s["n"]) == (3, 2, 4, 1, 5, 5)
    assert clock.summarise([7])["q3"] == 7
    with pytest.raises(ValueError):
        clock.summarise([])


def test_config_fails_before_model_work():
    for bad in (dict(r=1.5), dict(repeats=0), dict(sizes=[]), dict(methods=["nope"]), dict(tokenizer=None)):
        with pytest.raises(ValueError):
            LatencyConfig(**{"tokenizer": "x", **bad}).validate()


def test_run_and_table(tokenizer_dir, tmp_path):
    cfg = LatencyConfig(model="timing-qwen2.5-vl-test", tokenizer=str(tokenizer_dir), sizes=[1, 2], page_px=56,
                        methods=["reuse", "conduit"], repeats=2, warmup=0, device="cpu")
    rows = run_conduit_latency(cfg, log=lambda *_: None)
    raw = pd.DataFrame(rows, columns=RAW_COLUMNS)
    assert len(raw) == 2 * 3 * 2 and set(raw["method"]) == {"full", "reuse", "conduit"}
    raw_csv = tmp_path / "raw.csv"
    raw.to_csv(raw_csv, index=False)
    write_table3(raw_csv, tmp_path / "table3.csv", "ci")
    first = (tmp_path / "table3.csv").read_text().splitlines()[0]
    assert first.startswith("# kvbench ci profile") and "RANDOM weights" in first and "not the paper's numbers" in first
    table = pd.read_csv(tmp_path / "table3.csv", comment="#")
    assert list(table["method"].unique()) == ["full", "reuse", "conduit"]
    full = table[table["method"] == "full"]
    assert (full["speedup"] == 1).all() and (full["pct_of_full_flops"] == 100).all()
    assert (full["flop_bound_share"] == 1).all()
    assert table["flop_bound_share"].tolist() == pytest.approx(   # the CSV keeps 6 significant digits
        (table["speedup"] * table["pct_of_full_flops"] / 100).tolist(), rel=1e-4)
    assert table["flops_rel_err"].abs().max() < FLOPS_RTOL
    conduit = table[(table["method"] == "conduit") & (table["pages"] != "mean")]
    assert (conduit["scoring_ms_median"] > 0).all() and (conduit["scoring_tflops"] > 0).all()
    assert dict(zip(table["method"], table["r"])) == {"full": 1.0, "reuse": 0.0, "conduit": 0.1}   # fixed r of the refs
    with pytest.raises(ValueError, match="full"):
        build_table3(raw[raw["method"] != "full"])
    # Table 1's labels name a method's row alike in both tables (issue #33: 'MPIC' meant two forms)
    labelled = build_table3(raw, {"conduit": "CONDUIT", "reuse": "Cache reuse"})
    assert set(labelled["label"]) == {"Full prefill", "Cache reuse", "CONDUIT"}
    clash = build_table3(raw, {"full": "CONDUIT"})  # a policy label Table 1 gives another method names its method
    assert set(clash["label"]) == {"CONDUIT", "Cache reuse (r=0)", "CONDUIT [conduit]"}
    # bug: with no scoring-pass method timed, the mean rows lost the scoring column ("spec lacks key ...")
    raw[raw["method"] != "conduit"].to_csv(raw_csv, index=False)
    no_scoring = write_table3(raw_csv, tmp_path / "table3.csv", "ci")
    assert no_scoring["scoring_ms_median"].isna().all() and len(no_scoring) == 2 * 3


@pytest.mark.parametrize("bad,match", [
    ({"sizes": [4, 4]}, "distinct"),
    ({"page_px": 100}, "multiple of 28"),
    ({"methods": ["conduit@0.2"]}, "without a budget"),
    ({"methods": ["conduit:nope=1"]}, "nope"),
    ({"methods": ["nope"]}, "nope"),
])
def test_config_refused_before_model_work(bad, match):
    with pytest.raises(ValueError, match=match):
        LatencyConfig(**{"model": "timing-qwen2.5-vl-test", "tokenizer": "x", **bad}).validate()


def test_missing_tokenizer_is_named(tmp_path):
    cfg = LatencyConfig(model="timing-qwen2.5-vl-test", tokenizer=str(tmp_path / "none"), sizes=[1], page_px=56)
    with pytest.raises(ValueError, match="has no tokenizer.json"):
        run_conduit_latency(cfg, log=lambda *_: None)


def test_as_run_phase2_is_a_table3_method(tokenizer_dir, tmp_path):
    """The authors' as-run CONDUIT (query-only Phase 2) is timed as its own row; its analytic FLOPs follow the text
    rows it really computes (flops_rel_err 0) and it costs less than the all-text form."""
    cfg = LatencyConfig(model="timing-qwen2.5-vl-test", tokenizer=str(tokenizer_dir), sizes=[3], page_px=56,
                        methods=["conduit", "conduit:phase2_text=query"], repeats=1, warmup=0, device="cpu")
    raw = pd.DataFrame(run_conduit_latency(cfg, log=lambda *_: None), columns=RAW_COLUMNS)
    raw.to_csv(tmp_path / "raw.csv", index=False)
    table = write_table3(tmp_path / "raw.csv", tmp_path / "t3.csv", "ci").set_index(["method", "pages"])
    as_run, ours = table.loc[("conduit:phase2_text=query", "3")], table.loc[("conduit", "3")]
    assert as_run["label"] == "CONDUIT (phase2_text=query)"
    assert abs(as_run["flops_rel_err"]) < FLOPS_RTOL and as_run["prefill_tflops"] < ours["prefill_tflops"]


def test_table3_times_both_forms_under_table1_labels():
    """Table 1 scores CacheBlend and MPIC in CONDUIT's as-run forms (labels 'CacheBlend', 'MPIC') and CacheBlend's
    paper form: Table 3 times every one of them and its spec carries Table 1's labels (issue #33, item 4)."""
    import yaml

    from kvbench.plan.latency import LatencyPlan

    class WS:
        profile = "smoke"
        config = yaml.safe_load((Path(__file__).resolve().parents[1] / "config" / "config.yaml").read_text())

    labels = json.loads(LatencyPlan.from_config(WS, {}).table_spec(None))["labels"]
    table1 = {r["method"] for r in WS.config["conduit"]["methods"]}
    assert table1 <= set(TABLE3_METHODS)
    assert labels["cacheblend-conduit"] == "CacheBlend" and labels["mpic-first"] == "MPIC"
    assert labels["cacheblend"] == "CacheBlend (paper form)"
