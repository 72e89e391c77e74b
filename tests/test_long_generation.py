"""ResidualKV Table V, long generation: compression during decoding (SnapKV's decoding form, ResidualKV coding the
generated tokens), the chain task, the final-answer metric and seeded sampling."""
from __future__ import annotations

import random
import re

import pytest
import torch

from kvbench.compress.cache import Press
from kvbench.compress.generate import greedy_generate
from kvbench.compress.presses.snapkv import SnapKVPress
from kvbench.compress.presses.snapkv_decoding import SnapKVDecodingPress
from kvbench.compress.registry import PRESS
from kvbench.compress.residualkv.cache import ResidualKVPress
from kvbench.utils.spec import parse

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(3))


def _decode(model, press, n_new):
    """Greedy decoding of ``n_new`` tokens after the one-chunk prompt; returns (new ids, cache)."""
    return greedy_generate(model, press, PROMPT, PROMPT.shape[1], n_new, eos=set())


def test_snapkv_decoding_cache_stays_at_target_size(tiny_lm):
    press = SnapKVDecodingPress(keep=1.0, target_size=20, interval=4)
    new, cache = _decode(tiny_lm, press, 41)
    # 48 prompt tokens + 40 decode forwards: compressions after decode steps 4, 8, ..., 40
    for layer in cache.layers:
        assert layer.compressions == 10
        assert layer.kept_counts().tolist() == [20, 20]        # at the target right after the 10th compression
        assert layer.seen == 48 + 40
    assert len(new) == 41


def test_snapkv_decoding_never_exceeds_target_plus_interval(tiny_lm):
    press = SnapKVDecodingPress(keep=1.0, target_size=20, interval=4)
    cache = press.new_cache(tiny_lm)
    sizes = []
    from kvbench.compress.cache import press_attention
    with torch.inference_mode(), press_attention(tiny_lm, cache):
        tiny_lm(input_ids=PROMPT, position_ids=torch.arange(48).view(1, -1), cache=cache, use_cache=True)
        for step in range(30):
            ids = torch.tensor([[step % 256]])
            tiny_lm(input_ids=ids, position_ids=torch.tensor([[48 + step]]), cache=cache, use_cache=True)
            sizes.append(int(cache.layers[1].kept_counts().max()))
    # the prompt (48) is kept whole until the 4th decode step, then the cache is 20 + steps since the last compression
    assert sizes[:3] == [49, 50, 51]
    assert sizes[3:] == [20 + (s % 4) for s in range(27)]


def test_snapkv_decoding_keeps_the_buffered_steps_tokens(tiny_lm):
    press = SnapKVDecodingPress(keep=1.0, target_size=8, interval=8)
    _, cache = _decode(tiny_lm, press, 17)   # 16 decode forwards: compressions after steps 8 and 16
    positions = cache.layers[2]._stored.positions[0]
    assert positions.tolist() == [list(range(48 + 8, 48 + 16))] * 2


def test_snapkv_decoding_equals_snapkv_when_the_interval_is_never_reached(tiny_lm):
    got, cache = _decode(tiny_lm, SnapKVDecodingPress(keep=0.5, window=8, target_size=64, interval=64), 30)
    want, ref = _decode(tiny_lm, SnapKVPress(keep=0.5, window=8), 30)
    assert got == want
    for a, b in zip(cache.layers, ref.layers):
        assert a.compressions == 0
        assert torch.equal(a._stored.positions, b._stored.positions)


def test_snapkv_decoding_is_the_full_cache_while_nothing_is_evicted(tiny_lm):
    got, _ = _decode(tiny_lm, SnapKVDecodingPress(keep=1.0, target_size=1000, interval=4), 30)
    want, _ = _decode(tiny_lm, Press(), 30)
    assert got == want


@pytest.mark.parametrize("kw, match", [
    ({"interval": 0}, "interval must be >= 1"), ({"target_size": 4, "interval": 8}, "target_size must be >= interval"),
    ({"interval": 2.5}, "interval must be an int"), ({"target_size": True}, "target_size must be an int"),
    ({"keep": 0.0}, "keep must be in"),
])
def test_snapkv_decoding_bad_parameters_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        SnapKVDecodingPress(**kw)


def test_snapkv_decoding_is_a_press_spec():
    spec = parse("snapkv_decoding:keep=1.0,target_size=128,interval=8", PRESS)
    press = spec.build()
    assert isinstance(press, SnapKVDecodingPress) and (press.target_size, press.interval) == (128, 8)


def test_residualkv_codes_generated_tokens_as_they_leave_the_window(tiny_lm, tmp_path):
    from test_rkv_cache import _identity_codec

    codec_dir = _identity_codec(tiny_lm, tmp_path / "id", n_sink=2, window=4, stride=5)
    press = ResidualKVPress(codec_dir=str(codec_dir), block=1)
    coded = []
    for n_new in (1, 11, 21):
        _, cache = _decode(tiny_lm, press, n_new)
        layer = cache.layers[1]
        coded.append(len(layer.codes) + len(layer.pool))
        assert len(layer.window) == 4
    # 48 prompt tokens: 2 sinks, 4 raw, 42 coded or references; each decode forward codes one more token
    assert coded == [42, 52, 62]


# -- sampling ---------------------------------------------------------------------------------------
def test_sampling_greedy_top_k_and_top_p():
    from kvbench.compress.generate import GREEDY, Sampling

    logits = torch.tensor([0.0, 3.0, 2.0, -1.0])
    assert GREEDY.pick(logits) == 1
    torch.manual_seed(0)
    assert {Sampling(temperature=1.0, top_k=1).pick(logits) for _ in range(20)} == {1}
    # probabilities 0.035, 0.70, 0.26, 0.013: top-p 0.9 keeps tokens 1 and 2 only
    assert {Sampling(temperature=1.0, top_p=0.9).pick(logits) for _ in range(200)} == {1, 2}
    assert len({Sampling(temperature=5.0).pick(logits) for _ in range(200)}) == 4


@pytest.mark.parametrize("kw, match", [({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"),
                                       ({"top_k": -2}, "top_k"), ({"top_k": 1.5}, "top_k")])
def test_sampling_bad_settings_raise(kw, match):
    from kvbench.compress.generate import Sampling

    with pytest.raises(ValueError, match=match):
        Sampling(**kw)


def test_sampled_decode_is_a_function_of_the_seed(tiny_lm):
    from kvbench.compress.generate import Sampling

    s = Sampling(temperature=0.6, top_p=0.95, top_k=20)
    runs = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        runs.append(greedy_generate(tiny_lm, Press(), PROMPT, 48, 12, eos=set(), sampling=s)[0])
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_compress_method_records_sampling_only_when_it_samples():
    from kvbench.eval.compress import CompressMethod

    assert "sampling" not in CompressMethod(spec="fullkv").config()
    cfg = CompressMethod(spec="fullkv", temperature=0.6, top_p=0.95, top_k=20).config()
    assert cfg["sampling"] == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    with pytest.raises(ValueError, match="top_p"):
        CompressMethod(spec="fullkv", top_p=2.0)


# -- the chain task and its metric ------------------------------------------------------------------
def test_chain_record_is_an_induction_chain(tokenizer):
    from kvbench.data.smoke import sample

    r = sample("chain", random.Random(0), "test", tokenizer, hops=40, n_distractors=2)
    chain = r["answer"].split()
    assert len(chain) == 40 == r["max_new_tokens"] and r["meta"]["final"] == chain[-1]
    stmts = [s.split() for s in r["context"][len("Chains:"):].split(".") if s.strip()]
    assert len(stmts) == 3 * 40
    nxt = {a: b for a, b in stmts}
    x, walked = r["meta"]["num"], []
    for _ in range(40):
        x = nxt[x]
        walked.append(x)
    assert walked == chain
    # each hop's latest earlier occurrence is its own statement's key: the statement naming it comes before
    order = {tuple(s): i for i, s in enumerate(stmts)}
    assert all(order[(a, b)] < order[(b, c)] for a, b, c in zip([r["meta"]["num"]] + chain, chain, chain[1:]))
    assert "extra_queries" not in r["meta"] and r["metric"] == "final_answer"
    train = sample("chain", random.Random(0), "train", tokenizer, hops=16, min_hops=8, n_distractors=1)
    assert 8 <= train["meta"]["hops"] <= 16 and len(train["meta"]["extra_queries"]) == 1


@pytest.mark.parametrize("kw, match", [({"hops": 0}, "hops"), ({"hops": 8, "min_hops": 9}, "min_hops"),
                                       ({"n_distractors": -1}, "n_distractors"), ({"hops": 800}, "lexicon has")])
def test_chain_bad_parameters_raise(tokenizer, kw, match):
    from kvbench.data.chain import sample_chain

    with pytest.raises(ValueError, match=match):
        sample_chain(random.Random(0), "test", tokenizer, **kw)


@pytest.mark.parametrize("pred, gold, score", [
    (" AB CD EF", " XX YY EF", 1.0), (" AB CD", " AB CE", 0.0), ("", "", 0.0),
    ("so the answer is \\boxed{204}.", "204", 1.0), ("\\boxed{\\frac{1}{2}} then \\boxed{33}", "33", 1.0),
    ("\\boxed{3", "3", 0.0)])
def test_final_answer_metric(pred, gold, score):
    from kvbench.eval.metrics import final_answer

    assert final_answer(pred, gold) == score


# -- Table V: plan, writer, workflow ----------------------------------------------------------------
GEN_SECTION = {
    "model": "tiny-qwen2-lm", "tasks": ["kv_1k"], "n_test": 2, "threads": 1,
    "codec": {"d_c": 32, "d_ff": 192, "n_sink": 8, "stride": 10, "window": 32},
    "train": {"objective": "joint", "steps": 10, "seq_len": 64, "lr": 0.001, "data": "tasks"},
    "tableIII": [{"label": "Full cache", "method": "fullkv"}],
    "tableV": [{"label": "Full cache", "method": "fullkv"},
               {"label": "SnapKV", "method": "snapkv_decoding:keep=1.0,target_size=64,interval=8"},
               {"label": "ResidualKV", "method": "residualkv+omnikv:full_layers=0+1,keep=0.2"}],
    "long_generation": {"model": "tiny-qwen2-lm-chain", "tasks": ["chain_128"], "n_test": 3,
                        "train": {"data": "chain"}},
}


def test_table_v_runs_on_the_long_generation_backbone():
    from kvbench.plan.generation import generation_plan, generation_section
    from kvbench.plan.residualkv import RKVPlan

    main = RKVPlan(GEN_SECTION, "smoke")
    assert main.targets() == ["tableIII"]          # Table V is left to long_generation's plan
    plan = generation_plan(GEN_SECTION, "smoke", seed=0, model_dir="zoo/smoke/chain")
    assert plan.targets() == ["tableV"] and plan.model == "tiny-qwen2-lm-chain" and plan.s["n_test"] == 3
    assert plan.s["threads"] == 1 and plan.s["train"] == {**GEN_SECTION["train"], "data": "chain"}
    assert plan.run_dir("chain_128", plan.rows("tableV")[1].spec).startswith(
        "results/runs/smoke/tiny-qwen2-lm-chain/chain_128/residualkv/snapkv_decoding_")
    assert plan.codecs.dir("main").startswith("codecs/smoke/tiny-qwen2-lm-chain/main-")
    with pytest.raises(ValueError, match="long_generation: missing \\['tasks'\\]"):
        generation_section({**GEN_SECTION, "long_generation": {"model": "m"}})
    with pytest.raises(ValueError, match="unknown \\['bogus'\\]"):
        generation_section({**GEN_SECTION, "long_generation": {**GEN_SECTION["long_generation"], "bogus": 1}})
    with pytest.raises(ValueError, match="set long_generation"):
        generation_section({k: v for k, v in GEN_SECTION.items() if k != "long_generation"})
    with pytest.raises(ValueError, match="sampling: unknown key"):
        generation_section({**GEN_SECTION, "long_generation": {**GEN_SECTION["long_generation"],
                                                               "sampling": {"temp": 0.6}}})
    with pytest.raises(ValueError, match="top_p"):
        generation_section({**GEN_SECTION, "long_generation": {**GEN_SECTION["long_generation"],
                                                               "sampling": {"temperature": 0.6, "top_p": 1.5}}})


def test_table_v_cells_and_header(tmp_path):
    import pandas as pd

    from kvbench.report import tables
    from kvbench.plan.generation import generation_section
    from kvbench.utils.io import write_jsonl

    section = generation_section(GEN_SECTION)
    spec = {"profile": "smoke", "residualkv": section, "seed": 0, "model_dir": str(tmp_path / "absent"), "zoo": True,
            "splits": {"chain_128": "split.jsonl"}}
    from kvbench.plan.residualkv import RKVPlan

    plan = RKVPlan.from_spec(spec)
    for row, scores, kr, gen in zip(plan.rows("tableV"), ([1, 1, 0], [0, 0, 0], [1, 0, 1]), (1.0, 0.3, 0.25),
                                    (128, 128, 64)):
        rows = [{"id": str(i), "score": s, "status": "ok",
                 "plan": {"kr_packed": kr, "kr_resident": 2 * kr, "cr": kr, "n_tokens": 900, "n_generated": gen}}
                for i, s in enumerate(scores)]
        write_jsonl(tmp_path / plan.run_dir("chain_128", row.spec) / "predictions.jsonl", rows)
    write_jsonl(tmp_path / "split.jsonl", [{"id": f"p{i}-{k}", "meta": {"problem": f"p{i}"}} for i in range(2) for k in range(4)])
    tables.write("residualkv/tableV", spec, tmp_path / "t5.csv", root=tmp_path)
    df = pd.read_csv(tmp_path / "t5.csv", comment="#")
    pairs = df[df["kind"] == "paired difference"].set_index("method")
    assert list(pairs.index) == ["Full cache − SnapKV", "Full cache − ResidualKV", "SnapKV − ResidualKV"]
    assert pairs.loc["Full cache − SnapKV", "diff"] == 66.67 and pairs.loc["SnapKV − ResidualKV", "KR_packed % diff"] == 5
    df = df[df["kind"] == "score"]
    assert df["method"].tolist() == ["Full cache", "SnapKV", "ResidualKV"]
    assert df["chain_128"].round(2).tolist() == [66.67, 0.0, 66.67] and df["avg"].round(2).tolist() == [66.67, 0.0, 66.67]
    assert df["KR_packed %"].tolist() == [100.0, 30.0, 25.0] and df["CR %"].tolist() == [100.0, 30.0, 25.0]
    assert df["generated tokens"].tolist() == [128.0, 128.0, 64.0] and df["sequence tokens"].tolist() == [900.0] * 3
    header = (tmp_path / "t5.csv").read_text()
    assert "tiny zoo LM trained here, not the paper's models" in header and "greedy decoding" in header
    assert "a long-generation smoke task in place of AIME" in header   # it said "in place of LongBench"
    assert "records per problem: chain_128 4 (score = pass@1" in header
    assert "SnapKV: snapkv_decoding:interval=8,keep=1.0,protocol=one_pass,target_size=64" in header



def test_an_imported_main_codec_is_not_inherited_by_another_backbone():
    """With residualkv.codec.import (an authors' compressor for residualkv.model), Table V's chain model inherited
    the import and its runs asked for a codec no rule makes (the hostile-config dry run failed); another backbone now
    inherits the settings only and trains its own; the same backbone keeps the import."""
    from kvbench.plan.generation import generation_section

    section = {**GEN_SECTION, "codec": {**GEN_SECTION["codec"], "import": "compressors/theirs"}}
    assert generation_section(section)["codec"] == GEN_SECTION["codec"]
    same = {**section, "long_generation": {**section["long_generation"], "model": "tiny-qwen2-lm"}}
    assert generation_section(same)["codec"]["import"] == "compressors/theirs"
    own = {**section, "long_generation": {**section["long_generation"], "codec": {"import": "compressors/chain"}}}
    assert generation_section(own)["codec"] == {"import": "compressors/chain"}


def test_table_v_smoke_dry_run(tmp_path):
    """On the tiny zoo Table V is in the default profile. Its chain model is `on_demand`: Table V's target trains it,
    the default target (the zoo report) does not, and its floor error names Table V (it named Tables III/VI-VIII)."""
    from test_workflow import CONFIG, load, planned_jobs, snakemake

    r = snakemake(tmp_path, "-n", "-p", "results/residualkv/tableV.csv")
    assert r.returncode == 0, r.stdout[-3000:]
    jobs = planned_jobs(r.stdout)
    n_rows = len(load(CONFIG)["residualkv"]["tableV"])   # 4 methods and 3 attribution rows (issue #32)
    assert jobs["eval"] == n_rows and jobs["rkv_codec"] == 1 and jobs["train"] == 1 and jobs["table"] == 1
    assert "kvbench train --model tiny-qwen2-lm-chain " in r.stdout and '"chain_pairs_64": 0.5' in r.stdout
    assert "--feeds 'the targets that name it (ResidualKV Table V when it is residualkv.long_generation.model)'" in r.stdout
    assert re.search(r"--out codecs/smoke/tiny-qwen2-lm-chain/main-[0-9a-f]{8} .*--data chain ", r.stdout)
    assert not re.search(r"zoo/smoke/tiny-qwen2-lm-[0-9a-f]{8}", r.stdout)   # Table V never touches the main zoo LM
    assert r.stdout.count("--split data/smoke/chain_pairs_64-") == n_rows and "--limit 50" in r.stdout
    default = snakemake(tmp_path, "-n", "-p")
    assert default.returncode == 0, default.stdout[-3000:]
    assert "tiny-qwen2-lm-chain" not in default.stdout and "kvbench train --model tiny-qwen2-lm " in default.stdout


def test_table_v_paper_dry_run(tmp_path):
    from test_workflow import PAPER_CONFIG, _fake_paper_root, planned_jobs, snakemake

    root = tmp_path / "kvbench-data"
    _fake_paper_root(root)
    r = snakemake(tmp_path, "-n", "-p", "results/residualkv/tableV.csv", "--configfile", str(PAPER_CONFIG),
                  "--config", f"paths={{root: {root}}}")
    assert r.returncode == 0, r.stdout[-3000:]
    jobs = planned_jobs(r.stdout)
    assert jobs == {"eval": 4, "rkv_codec": 1, "table": 1}
    assert r.stdout.count(f"kvbench eval --model {root}/checkpoints/Qwen3-4B-Thinking-2507 ") == 4
    assert r.stdout.count(f"--split {root}/benchmarks/aime/aime_x8.jsonl ") == 4
    evals = [line for line in r.stdout.splitlines() if line.startswith("Shell command: kvbench eval")]
    assert len(evals) == 4 and all('"temperature": 0.6' in e and '"top_p": 0.95' in e and '"top_k": 20' in e
                                   for e in evals)   # every run samples (method params)
    assert re.search(r"--out codecs/paper/qwen3-4b-thinking/main-[0-9a-f]{8} ", r.stdout)
    assert "snapkv_decoding:interval=10,keep=1.0,kernel=7,pooling=max,protocol=one_pass,target_size=2048" in r.stdout


def test_table_v_backbone_imports_its_own_compressor(tmp_path):
    """`long_generation.codec.import` (the chain backbone's own authors' compressor) planned a run reading
    codecs/.../main-import-<hash> that no rule made (MissingInputException); rkv_codec_import now serves it."""
    from test_rkv_deltakv_format import write_theirs
    from test_workflow import CONFIG, load, planned_jobs, snakemake, write_config

    cfg = load(CONFIG)
    codec = cfg["residualkv"]["codec"]
    shape = {"num_hidden_layers": 8, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 32}
    write_theirs(tmp_path / "chain compressor", shape, bias=False, d_c=codec["d_c"], d_ff=codec["d_ff"])
    cfg["residualkv"]["long_generation"]["codec"] = {"import": str(tmp_path / "chain compressor")}
    (tmp_path / "work").mkdir()
    r = snakemake(tmp_path / "work", "-n", "-p", "results/residualkv/tableV.csv", "--configfile",
                  str(write_config(tmp_path / "c.yaml", cfg)))
    assert r.returncode == 0, r.stdout[-3000:]
    jobs = planned_jobs(r.stdout)
    assert jobs["rkv_codec_import"] == 1 and "rkv_codec" not in jobs
    assert re.search(r"kvbench codec-import --from-deltakv '[^']*chain compressor' --out "
                     r"codecs/smoke/tiny-qwen2-lm-chain/main-import-[0-9a-f]{8}/codec --model zoo/smoke/tiny-qwen2-lm-chain-",
                     r.stdout), r.stdout[-3000:]


@pytest.mark.parametrize("change, match", [
    # both passed the dry run and failed only when the runs started, after the chain model's hour of training
    ({"long_generation": {"tasks": ["docpages"]}}, r"long_generation\.tasks: 'docpages' is a `vlm` dataset"),
    ({"tableV": [{"label": "FastV", "method": "fastv"}]}, r"row 'FastV': 'fastv' answers vlm records only"),
    ({"long_generation": {"train": {"data": "chian"}}}, r"chian"),
    ({"long_generation": {"train": {"stpes": 10}}}, r"stpes"),
    # an on-demand model in the matrix was still trained by the default target, its curve left out of the figure
    ({"eval_matrix": "tiny-qwen2-lm-chain"}, r"eval\.matrix: model 'tiny-qwen2-lm-chain' is `zoo\.on_demand`"),
])
def test_bad_table_v_config_is_refused_in_the_dry_run(tmp_path, change, match):
    from test_workflow import CONFIG, load, write_config
    from test_workflow_config_keys import _chain, _dry_run

    cfg = load(CONFIG)
    for key, value in change.items():
        if key == "eval_matrix":
            cfg["eval"]["matrix"][value] = ["niah_1k"]
        elif isinstance(value, dict):
            for k, v in value.items():
                cfg["residualkv"][key][k] = {**cfg["residualkv"][key].get(k, {}), **v} if isinstance(v, dict) else v
        else:
            cfg["residualkv"][key] = value
    (tmp_path / "work").mkdir()
    with pytest.raises(Exception) as e:
        _dry_run(write_config(tmp_path / "c.yaml", cfg), ["results/residualkv/tableV.csv"], tmp_path / "work")
    assert re.search(match, _chain(e.value)), _chain(e.value)


def test_decode_tail_reaches_every_row_but_table_v_s():
    """The section's decode_tail is added to every row (unless a row spells its own) and named in the header's
    protocol line; Table V's long_generation plan does not inherit it (its answers decode through the cache)."""
    from kvbench.plan.generation import generation_plan
    from kvbench.plan.residualkv import RKVPlan, press_spec

    section = {**GEN_SECTION, "decode_tail": 1,
               "tableIII": [{"label": "Full cache", "method": "fullkv"},
                            {"label": "own", "method": "snapkv:keep=0.3,decode_tail=0"}]}
    plan = RKVPlan(section, "smoke")
    tails = [press_spec(r.spec).params.get("decode_tail", 0) for r in plan.rows("tableIII")]
    assert tails == [1, 0]
    note = plan.protocol_note("tableIII")
    assert note.startswith("one_pass:") and "decode_tail=0/1: the question's last token(s)" in note
    assert "decode_tail" not in RKVPlan(GEN_SECTION, "smoke").protocol_note("tableIII")
    gen = generation_plan(section, "smoke", seed=0, model_dir="zoo/smoke/chain")
    assert all("decode_tail" not in press_spec(r.spec).params for r in gen.rows("tableV"))
