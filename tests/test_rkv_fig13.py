"""ResidualKV Fig. 13 (visual case): references of one image's visual tokens as the cache stores them
(kvbench.compress.residualkv.visual_case), the CSV and figure (kvbench.report.residualkv.fig13), and the workflow targets."""
from __future__ import annotations

import dataclasses
import json
import re

import pandas as pd
import pytest
import torch
from _reuse_fixtures import random_image, record, tiny_vlm

from kvbench.compress.residualkv import references
from kvbench.compress.residualkv.observations import ReferenceSchedule, layer_kv
from kvbench.compress.residualkv.visual_case import (
    StoreSchedule,
    check_layers,
    patch_coords,
    stored_references,
    visual_case,
)
from kvbench.kernels import quant
from kvbench.report.residualkv import fig13 as rkv_fig13

pytestmark = pytest.mark.usefixtures("one_thread")

#: the press drawn: layer 0 kept whole (as Table II's row keeps 0 and 1), references FP8 (the default)
SPEC = "residualkv+omnikv:full_layers=0,keep=0.1,sparse_prefill=true,protocol=shared_context"


@pytest.fixture(scope="module")
def vlm(tokenizer):
    return tiny_vlm(tokenizer, seed=3, num_hidden_layers=4)


@pytest.fixture(scope="module")
def rec():
    """One page of 112 x 168 px: a 4 x 6 merged grid (28 px a visual token), 24 visual tokens."""
    r = record([7], question="Page 1, cell B")
    r["content"][1]["image"] = random_image(7, h=112, w=168)
    return r


@pytest.fixture(scope="module")
def press(vlm, tmp_path_factory):
    from kvbench.compress.residualkv.codec import ResidualCodec
    from kvbench.plan.residualkv import press_spec

    model, _ = vlm
    out = tmp_path_factory.mktemp("fig13codec")
    ResidualCodec.for_model(model, d_c=16, d_ff=16, n_sink=2, window=4, stride=5).save(out)
    p = press_spec(SPEC).build(codec_dir=str(out))
    p.load()
    return p


def test_patch_coords_are_row_major_on_each_merged_grid():
    c = patch_coords([(1, 2, 3), (1, 4, 6)])
    assert c.shape == (30, 4) and c[:6, 0].eq(0).all() and c[6:, 0].eq(1).all()
    for i in range(24):   # token i of the second image sits at row i // W, column i % W
        assert c[6 + i].tolist() == [1, 0, i // 6, i % 6]
    assert patch_coords([(2, 1, 2)]).tolist() == [[0, 0, 0, 0], [0, 0, 0, 1], [0, 1, 0, 0], [0, 1, 0, 1]]
    with pytest.raises(ValueError, match="side below 1"):
        patch_coords([(1, 0, 3)])


def test_patch_mapping_agrees_with_the_models_own_mrope_positions(vlm, rec, press):
    """The model places visual token i at M-RoPE (h, w) offsets: the mapping must be that one."""
    from kvbench.compress.generate_vlm import encode_vlm, prompt_positions, visual_positions

    model, proc = vlm
    case = visual_case(model, proc, rec, None, StoreSchedule.of_press(press), [1], task="t")
    assert case.grids == [(1, 4, 6)] and len(case.visual) == 24
    pos = prompt_positions(model, encode_vlm(model, proc, rec, None))[:, 0]          # [3, T]
    vis = visual_positions(model, encode_vlm(model, proc, rec, None)["input_ids"])
    hw = pos[1:, vis] - pos[1:, vis].min(dim=1, keepdim=True).values                  # [2, n_vis]: (h, w) offsets
    assert torch.equal(hw.T, case.coords[:, 2:])


def test_stored_references_are_the_references_functions_on_the_same_kv():
    """Pool: the paper grid from n_sink on, FP8 round trip; k nearest earlier by squared L2 (independent recomputation)."""
    torch.manual_seed(0)
    kv = torch.randn(60, 12) * 3
    sched = StoreSchedule(ReferenceSchedule(k=3, n_sink=4, stride=5), ref_fp8=True)
    t = stored_references(kv, sched)
    pos = torch.arange(60)
    is_ref = references.reference_mask(pos, n_sink=4, stride=5)
    assert torch.equal(t.ref_positions, pos[is_ref])
    assert torch.equal(t.positions, pos[~is_ref & (pos >= 4)])
    pool = quant.from_fp8(quant.to_fp8(kv[is_ref])[0])
    for i, p in enumerate(t.positions.tolist()):     # brute force: sort the visible pool by distance
        vis = pos[is_ref] < p
        d = ((kv[p] - pool[vis]) ** 2).sum(1)
        want = pos[is_ref][vis][d.argsort()[:3]]
        n = min(3, int(vis.sum()))
        assert t.refs[i, :n].tolist() == want[:n].tolist() and t.valid[i].sum() == n
        assert torch.allclose(t.sq_dist[i, :n], d.sort().values[:n], rtol=1e-4)
        assert (t.refs[i, n:] == -1).all() and t.sq_dist[i, n:].isnan().all()
    # float32 pool when the press keeps references unquantised: the ranking may differ, the pool does not
    assert torch.equal(stored_references(kv, StoreSchedule(sched.refs, ref_fp8=False)).ref_positions, t.ref_positions)


def test_csv_references_are_what_the_cache_stores(vlm, rec, press, tmp_path):
    """Fig. 13's CSV against (a) the references functions on the layers' captured K||V and (b) the index store of a
    real ResidualKV cache that ran the record (every visual token it coded)."""
    from kvbench.compress.generate_vlm import encode_vlm, greedy_generate_vlm, question_start

    model, proc = vlm
    sched = StoreSchedule.of_press(press)
    assert sched.full_layers == (0,) and sched.ref_fp8 and sched.refs.k == 4 and sched.refs.n_sink == 2
    case = visual_case(model, proc, rec, None, sched, [1, 3], task="t", model_name="tiny")
    df = rkv_fig13.write(case, tmp_path / "fig13.csv", "smoke", zoo=True)
    back = pd.read_csv(tmp_path / "fig13.csv", comment="#")
    assert len(back) == len(df) and set(back["layer"]) == {1, 3} and set(back["position"]) == set(case.visual.tolist())
    coded = back[back["stored_as"] == "coded"]
    inputs = encode_vlm(model, proc, rec, None)
    kv = dict(zip([1, 3], layer_kv(model, inputs, [1, 3])))
    _, cache = greedy_generate_vlm(model, press, inputs, question_start(proc, rec, inputs["input_ids"]), 2, set())
    checked = 0
    for layer in (1, 3):
        x = kv[layer]
        pos = torch.arange(len(x))
        is_ref = references.reference_mask(pos, n_sink=2, stride=5)
        pool = quant.from_fp8(quant.to_fp8(x[is_ref])[0])
        store = cache.layers[layer]
        _, nbr, valid = store.codes.rows()
        pool_pos = store.pool.positions()
        by_pos = {int(p): pool_pos[nbr[i][valid[i]]].tolist() for i, p in enumerate(store.codes.positions())}
        for p, d in coded[coded["layer"] == layer].groupby("position"):
            got = d.sort_values("rank")["ref_position"].tolist()
            idx, ok = references.nearest_references(x[p][None], torch.tensor([p]), pool, pos[is_ref], 4)
            assert got == pos[is_ref][idx[0][ok[0]]].tolist()
            if p in by_pos:
                assert got == by_pos[p], (layer, p)
                checked += 1
    assert checked >= 20   # the cache coded nearly every visual token (all but its raw window)
    kinds = set(coded["ref_kind"])
    assert kinds <= {"patch", "text"} and "patch" in kinds
    patch = coded[coded["ref_kind"] == "patch"]
    assert ((patch["patch_distance"] - ((patch["row"] - patch["ref_row"]) ** 2 + (patch["col"] - patch["ref_col"]) ** 2)
             ** 0.5).abs() < 1e-9).all()
    assert (coded["token_distance"] > 0).all()       # earlier tokens only
    raw = back[back["stored_as"] == "reference"]
    assert set(raw["position"]) == {p for p in case.visual.tolist() if p >= 2 and (p - 2) % 5 == 0}
    text = (tmp_path / "fig13.csv").read_text()
    assert "tiny zoo VLM" in text and "FP8 e4m3" in text and "4 x 6" in text


def test_figure_and_summary(vlm, rec, press, tmp_path):
    from kvbench.utils.io import write_jsonl

    model, proc = vlm
    img = tmp_path / "page.png"
    rec["content"][1]["image"].save(img)
    on_disk = {**rec, "content": [rec["content"][0], {"type": "image", "image": "page.png"}]}
    write_jsonl(tmp_path / "test.jsonl", [on_disk])
    case = visual_case(model, proc, on_disk, tmp_path, StoreSchedule.of_press(press), [1, 2, 3])
    rkv_fig13.write(case, tmp_path / "fig13.csv", "smoke", zoo=True)
    s = rkv_fig13.plot(tmp_path / "fig13.csv", tmp_path / "test.jsonl", tmp_path / "fig13.pdf",
                       tmp_path / "fig13_summary.csv", queries=3)
    assert (tmp_path / "fig13.pdf").read_bytes()[:4] == b"%PDF"
    assert list(s["layer"]) == ["1", "2", "3", "all"]
    shares = s[[f"share_{k}" for k in rkv_fig13.KINDS]].sum(axis=1)
    assert ((shares - 1).abs() < 1e-9).all() and (s["visual_tokens"] == 24).all()
    assert (s["stored_as_reference"] + s["coded"] + s["stored_as_sink"] == 24).all()
    assert s["chance_patch"].between(0, 1).all()
    assert "qualitative" in (tmp_path / "fig13_summary.csv").read_text()
    df = pd.read_csv(tmp_path / "fig13.csv", comment="#")
    q = rkv_fig13.query_tokens(df, 3)
    coded = sorted(df.loc[df["stored_as"] == "coded", "position"].unique())
    assert q == [coded[0], coded[len(coded) // 2 if len(coded) % 2 else round((len(coded) - 1) / 2)], coded[-1]]
    with pytest.raises(ValueError, match="no record with id"):
        rkv_fig13.image_of(tmp_path / "test.jsonl", "nope", 0)
    with pytest.raises(ValueError, match="1 image"):
        rkv_fig13.image_of(tmp_path / "test.jsonl", rec["id"], 1)


def test_bad_layers_images_and_records_are_named(vlm, rec, press):
    model, proc = vlm
    sched = StoreSchedule.of_press(press)
    with pytest.raises(ValueError, match=r"layers \[4\] outside the model's 4 decoder layers"):
        visual_case(model, proc, rec, None, sched, [1, 4])
    with pytest.raises(ValueError, match=r"layers \[0\] are full-attention layers"):
        check_layers([0, 2], 4, sched)
    with pytest.raises(ValueError, match="given twice"):
        check_layers([2, 2], 4, sched)
    with pytest.raises(ValueError, match="at least one"):
        check_layers([], 4, sched)
    with pytest.raises(ValueError, match=r"image 1: record 'r0' has 1 image"):
        visual_case(model, proc, rec, None, sched, [1], image=1)
    with pytest.raises(ValueError, match="kind 'text'"):
        visual_case(model, proc, {**rec, "kind": "text"}, None, sched, [1])
    # review: another model's codec drew another schedule's references without an error
    n_layers, d_kv = sched.codec_shape
    other = dataclasses.replace(sched, codec_shape=(n_layers + 2, d_kv))
    with pytest.raises(ValueError, match=rf"trained for \(n_layers, d_kv\) = \({n_layers + 2}, {d_kv}\)"):
        visual_case(model, proc, rec, None, other, [1])
    assert f"codec {press.codec_dir}" in sched.describe()


def test_cli_writes_the_csv_and_names_a_missing_record(vlm, rec, press, tmp_path, capsys):
    from kvbench.cli import main
    from kvbench.models.loader import save_checkpoint
    from kvbench.utils.io import write_jsonl

    model, proc = vlm
    mdir = save_checkpoint(model, proc, tmp_path / "vlm")
    rec["content"][1]["image"].save(tmp_path / "page.png")
    write_jsonl(tmp_path / "test.jsonl", [{**rec, "content": [rec["content"][0], {"type": "image", "image": "page.png"}]}])
    args = ["analyze", "rkv-visual-case", "--model", str(mdir), "--split", f"t={tmp_path / 'test.jsonl'}",
            "--method", SPEC, "--codec-dir", press.codec_dir, "--layers", "1", "3", "--out", str(tmp_path / "f.csv"),
            "--device", "cpu", "--zoo"]
    assert main(args) in (0, None)
    out = json.loads(capsys.readouterr().out)
    assert out["grid"] == [1, 4, 6] and set(out) >= {"layer 1", "layer 3", "layer all"}
    assert main(args[:-3] + ["--record", "1"] + args[-3:]) == 2
    assert "--record 1" in capsys.readouterr().err
    assert main(["analyze", "rkv-visual-case", "--model", str(mdir), "--split", f"t={tmp_path / 'test.jsonl'}",
                 "--method", "snapkv:keep=0.1", "--codec-dir", press.codec_dir, "--layers", "1", "--out",
                 str(tmp_path / "g.csv")]) == 2
    assert "not a ResidualKV press" in capsys.readouterr().err
    report = ["report", "residualkv-fig13", "--raw", str(tmp_path / "f.csv"), "--data-out", str(tmp_path / "s.csv")]
    assert main(report + ["--out", str(tmp_path / "f.pdf")]) == 2 and "--split" in capsys.readouterr().err
    assert main(report + ["--split", str(tmp_path / "test.jsonl"), "--out", str(tmp_path / "f.png")]) == 2
    assert main(report + ["--split", str(tmp_path / "test.jsonl"), "--out", str(tmp_path / "f.pdf"), "--queries", "2"]) == 0
    assert (tmp_path / "f.pdf").is_file() and (tmp_path / "s.csv").is_file()


# --- workflow -------------------------------------------------------------------------------------

def test_smoke_targets_plan_the_case_on_table_ii_codec(tmp_path):
    from test_workflow import CONFIG, load, planned_jobs, snakemake

    fig13 = load(CONFIG)["residualkv"]["fig13"]
    r = snakemake(tmp_path, "-n", "-p", "figures/fig13.pdf", "results/residualkv/fig13.csv")   # short name: ResidualKV's
    assert r.returncode == 0, r.stdout[-3000:]
    jobs = planned_jobs(r.stdout)
    assert jobs["rkv_visual_case"] == jobs["rkv_fig13"] == jobs["rkv_mm_codec"] == jobs["residualkv_figure_alias"] == 1
    codec = re.search(r"--out (codecs/smoke/tiny-qwen2\.5-vl/mm-[0-9a-f]{8}) ", r.stdout).group(1)   # rkv_mm_codec's
    assert f"--codec-dir {codec}/codec " in r.stdout   # the same directory, not a hash of its own
    assert "--method residualkv+omnikv:full_kv_bits=4,full_layers=0+1," in r.stdout   # Table II's ResidualKV row
    assert re.search(r"--split digitgrid=data/smoke/digitgrid-[0-9a-f]{8}/test\.jsonl ", r.stdout)
    assert f"--record {fig13['record']} --image 0 --layers {' '.join(map(str, fig13['layers']))} " in r.stdout
    assert "--zoo" in r.stdout and "kvbench report residualkv-fig13" in r.stdout


def test_fig13_defaults_live_in_the_schema_only():
    """record, image, queries, device and dtype default in the schema (validation fills them in); the rule files
    spell none of them again as a dict entry or a setdefault (they did, a second copy of the same values)."""
    import yaml
    from test_workflow import REPO

    schema = yaml.safe_load((REPO / "workflow" / "schemas" / "config.schema.yaml").read_text())
    props = schema["properties"]["residualkv"]["properties"]["fig13"]["properties"]
    defaulted = sorted(k for k, v in props.items() if "default" in v)
    assert defaulted == ["device", "dtype", "image", "queries", "record"]
    for path in sorted((REPO / "workflow" / "rules").glob("rkv_fig13*.smk")):
        text = path.read_text()
        again = [k for k in defaulted if re.search(rf"""["']{k}["']\s*[:,]""", text)]
        assert not again, f"{path.name} repeats the schema's defaults of {again}"


@pytest.mark.parametrize("change, match", [
    ({"layers": [0, 5]}, r"residualkv\.fig13\.layers: layers \[0\] are full-attention layers"),
    ({"layers": [30]}, r"residualkv\.fig13\.layers: layers \[30\] outside the model's 24"),
    ({"model": "tiny-qwen2-lm"}, r"residualkv\.fig13\.model: 'tiny-qwen2-lm' is not one of residualkv\.tableII\.models"),
    ({"task": "niah_1k"}, r"residualkv\.fig13\.task: 'niah_1k' must be a `vlm` dataset"),
    # an index past the smoke split was only refused when the job ran
    ({"record": 300}, r"residualkv\.fig13\.record: 300 is outside digitgrid's test split of 300 records"),
    (None, r"residualkv\.fig13 is not set"),
])
def test_bad_fig13_config_is_named_in_the_dry_run(tmp_path, change, match):
    from test_workflow import CONFIG, load, write_config
    from test_workflow_config_keys import _chain, _dry_run

    cfg = load(CONFIG)
    if change is None:
        del cfg["residualkv"]["fig13"]
    else:
        cfg["residualkv"]["fig13"].update(change)
    (tmp_path / "work").mkdir()
    with pytest.raises(Exception) as e:   # in this process (a DAG in about a second)
        _dry_run(write_config(tmp_path / "c.yaml", cfg), ["results/residualkv/fig13.csv"], tmp_path / "work")
    assert re.search(match, _chain(e.value)), _chain(e.value)


def test_paper_targets_resolve_on_local_checkpoints(tmp_path):
    from test_workflow import paper_dry_run, planned_jobs

    cfg, root, r = paper_dry_run(tmp_path, "figures/residualkv/fig13.pdf")
    s = cfg["residualkv"]["fig13"]
    assert planned_jobs(r.stdout) == {"rkv_mm_codec": 1, "rkv_visual_case": 1, "rkv_fig13": 1}
    assert f"--model {root}/{cfg['models'][s['model']]['checkpoint']} " in r.stdout
    assert f"--split {s['task']}={root}/{cfg['datasets'][s['task']]['jsonl']} " in r.stdout
    assert "full_layers=0+1+2+3+10+21+29" in r.stdout and "--layers 4 18 35 --device cuda --dtype bfloat16" in r.stdout
    assert "--zoo" not in r.stdout
