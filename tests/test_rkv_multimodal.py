"""ResidualKV Table II (kvbench.report.residualkv.table_ii): plan, writer, and the target in smoke and paper dry runs."""
from __future__ import annotations

import json
import re

import pandas as pd
import pytest
import yaml
from test_workflow import CONFIG, paper_dry_run, planned_jobs, snakemake

from kvbench.plan.multimodal import MMPlan
from kvbench.report.tables import TABLES
from kvbench.utils.io import write_jsonl

SECTION = {"models": ["tiny-qwen2.5-vl"], "tasks": ["docpages", "digitgrid"], "n_test": 2,
           "rows": [{"label": "Full cache", "method": "fullkv"}, {"label": "SnapKV", "method": "snapkv:keep=0.1"}]}


def test_plan_runs_rows_and_protocol():
    plan = MMPlan(SECTION, "smoke", {"tiny-qwen2.5-vl": True})
    assert [r.spec for r in plan.rows] == ["fullkv:protocol=shared_context", "snapkv:keep=0.1,protocol=shared_context"]
    runs = plan.runs()
    assert len(runs) == 4 and {r.group for r in runs} == {"residualkv_mm"}
    assert runs[0].path("smoke") == "results/runs/smoke/tiny-qwen2.5-vl/docpages/residualkv/fullkv_protocol-shared_context"
    own = MMPlan({**SECTION, "rows": [{"label": "F", "method": "fullkv:protocol=one_pass"}]}, "smoke", {})
    assert own.rows[0].spec == "fullkv:protocol=one_pass"


@pytest.mark.parametrize("change, match", [
    ({"rows": [{"label": "A", "method": "fullkv"}, {"label": "A", "method": "snapkv"}]}, "given twice"),
    ({"rows": [{"label": "R", "method": "residualkv"}]}, "row 'R'.*configure residualkv.tableII.codec"),
    ({"rows": [{"label": "R", "method": "fullkv", "models": ["other-vlm"]}]}, r"row 'R': models \['other-vlm'\]"),
    ({"rows": [{"label": "X", "method": "nosuchpress"}]}, "row 'X'"),
    ({"tasks": []}, r"misses key\(s\) \['tasks'\]"),
])
def test_plan_refuses_bad_sections(change, match):
    with pytest.raises(ValueError, match=match):
        MMPlan({**SECTION, **change}, "smoke", {})


def test_rows_may_be_restricted_to_backbones_and_codecs_are_per_backbone():
    section = {**SECTION, "models": ["a", "b"], "codec": {"config": {"d_c": 32}, "train": {"steps": 5}},
               "rows": [{"label": "Full cache", "method": "fullkv"},
                        {"label": "ResidualKV", "method": "residualkv:full_layers=0", "models": ["a"]},
                        {"label": "ResidualKV", "method": "residualkv:full_layers=0+1", "models": ["b"]}]}
    plan = MMPlan(section, "paper", {})
    assert [r.label for r in plan.rows_of("a")] == ["Full cache", "ResidualKV"]
    assert plan.rows_of("b")[1].spec.startswith("residualkv:full_layers=0+1")
    assert len(plan.runs()) == 2 * 2 * 2 and plan.takes_codec(plan.rows[1].spec) and not plan.takes_codec("fullkv")
    one = plan.codec_recipe("a", "ckpt/a", 0, ["t.jsonl"])
    assert one != plan.codec_recipe("b", "ckpt/b", 0, ["t.jsonl"])
    placed = MMPlan({**section, "codec": {**section["codec"], "train": {"steps": 5, "device": "cuda"}}}, "paper", {})
    assert placed.codec_recipe("a", "ckpt/a", 0, ["t.jsonl"]) == one   # where it trains is not in the recipe
    with pytest.raises(ValueError, match="given twice for 'a'"):
        MMPlan({**section, "rows": section["rows"] + [{"label": "ResidualKV", "method": "fullkv", "models": ["a"]}]},
               "paper", {})


def _fake_run(root, plan, model, task, spec, scores, kr, cr, kept):
    d = root / plan.run(model, task, spec).path(plan.profile)
    d.mkdir(parents=True)
    write_jsonl(d / "predictions.jsonl", [
        {"id": str(i), "status": "ok", "score": s,
         "plan": {"kr_packed": kr, "kr_resident": kr + 0.1, "cr": cr, "kept": kept, "n_tokens": 100}}
        for i, s in enumerate(scores)])


def test_table_ii_cells_and_header(tmp_path):
    spec = {"profile": "smoke", "tableII": SECTION, "zoo": {"tiny-qwen2.5-vl": True}}
    plan = MMPlan.from_spec(json.dumps(spec))
    for task, (full, snap) in {"docpages": ([1, 1], [1, 0]), "digitgrid": ([1, 0], [0, 0])}.items():
        _fake_run(tmp_path, plan, "tiny-qwen2.5-vl", task, plan.rows[0].spec, full, 1.0, 1.0, 1.0)
        _fake_run(tmp_path, plan, "tiny-qwen2.5-vl", task, plan.rows[1].spec, snap, 0.3, 0.2, 0.25)
    out = tmp_path / "results/residualkv/tableII.csv"
    TABLES["residualkv/tableII"].build(json.dumps(spec), str(out), str(tmp_path))
    df = pd.read_csv(out, comment="#").set_index("method")
    assert list(df.columns[:5]) == ["model", "kind", "spec", "docpages", "digitgrid"]
    assert df.loc["Full cache", "docpages"] == 100 and df.loc["Full cache", "avg"] == 75
    # the one pair of rows, paired by record id: per column, pooled over the 4 records, and KR/CR per record
    pair = df.loc["Full cache − SnapKV"]
    assert pair["kind"] == "paired difference" and pair["model"] == "tiny-qwen2.5-vl"
    assert (pair["docpages"], pair["digitgrid"], pair["diff"], pair["n"]) == (50, 50, 50, 4)
    assert (pair["wins"], pair["losses"], pair["ties"]) == (2, 0, 2)
    assert pair["KR_packed % diff"] == 70 and pair["CR % diff"] == 80 and pair["CR % told_apart"]
    assert df.loc["SnapKV", "avg"] == 25 and df.loc["SnapKV", "KR_packed %"] == 30
    assert df.loc["SnapKV", "KR_resident %"] == 40 and df.loc["SnapKV", "CR %"] == 20 and df.loc["SnapKV", "kept %"] == 25
    header = [ln for ln in out.read_text().splitlines() if ln.startswith("#")]
    text = " ".join(header)
    assert "tiny zoo VLM" in text and "not the paper's numbers" in text
    assert "7/36 = 19.4%" in text and "SnapKV: keep=0.1" in text and "Full cache: full cache" in text


def test_cr_lower_bound_is_computed_from_the_rows_full_layers_and_the_runs_layer_count(tmp_path):
    """The header's CR caveat was only the paper's 7/36 (Qwen3-VL-8B, §V-A, Table I); each row that keeps full layers now gets its own
    bound beta = |full_layers| / layers, the layer count read from its runs' audit (bytes by layer)."""
    from kvbench.report.residualkv.table_ii import cr_bounds

    rows = [{"label": "Full cache", "method": "fullkv"},
            {"label": "ResidualKV", "method": "residualkv:full_layers=0+1+5"}]
    plan = MMPlan({**SECTION, "rows": rows, "codec": {"config": {}}}, "smoke", {})
    for task in plan.tasks:
        for row in plan.rows:
            d = tmp_path / plan.run("tiny-qwen2.5-vl", task, row.spec).path("smoke")
            d.mkdir(parents=True)
            write_jsonl(d / "predictions.jsonl", [{"id": "0", "status": "ok", "score": 1,
                                                    "plan": {"bytes": [10] * 24, "cr": 0.5}}])
    line = cr_bounds(plan, tmp_path)
    assert "tiny-qwen2.5-vl ResidualKV: 3/24 = 12.5%" in line and "Full cache" not in line and "7/36 = 19.4%" in line
    d = tmp_path / plan.run("tiny-qwen2.5-vl", "digitgrid", plan.rows[1].spec).path("smoke")
    write_jsonl(d / "predictions.jsonl", [{"id": "0", "status": "ok", "score": 1, "plan": {"bytes": [10] * 36}}])
    assert "runs disagree on the layer count [24, 36]" in cr_bounds(plan, tmp_path)
    assert cr_bounds(MMPlan(SECTION, "smoke", {}), tmp_path) == ""   # no row keeps full layers


def test_missing_run_is_named(tmp_path):
    spec = {"profile": "smoke", "tableII": SECTION, "zoo": {}}
    with pytest.raises(FileNotFoundError, match="docpages/residualkv/fullkv_protocol-shared_context"):
        TABLES["residualkv/tableII"].build(spec, str(tmp_path / "t.csv"), str(tmp_path))


def test_smoke_target_plans_its_vlm_runs(tmp_path):
    section = yaml.safe_load(CONFIG.read_text())["residualkv"]["tableII"]
    r = snakemake(tmp_path, "-n", "-p", "results/tableII.csv")   # the short name resolves to ResidualKV's
    assert r.returncode == 0, r.stdout[-3000:]
    assert planned_jobs(r.stdout)["eval"] == len(section["rows"]) * len(section["tasks"]) * len(section["models"])
    assert "--method snapkv:keep=0.1,protocol=shared_context" in r.stdout
    assert f"--limit {section['n_test']}" in r.stdout and "tiny-qwen2.5-vl/docpages/residualkv/" in r.stdout
    # the ResidualKV row's codec: trained on the VLM's own train splits (visual tokens included), read by its runs
    assert planned_jobs(r.stdout)["rkv_mm_codec"] == 1
    codec = re.search(r"--out (codecs/smoke/tiny-qwen2\.5-vl/mm-[0-9a-f]{8}) ", r.stdout).group(1)
    assert re.search(r"--data vlm --data-files data/smoke/docpages-[0-9a-f]{8}/train\.jsonl "
                     r"data/smoke/digitgrid-[0-9a-f]{8}/train\.jsonl ", r.stdout)
    assert f'"codec_dir": "{codec}/codec"' in r.stdout


def test_paper_target_resolves_on_local_checkpoints(tmp_path):
    cfg, root, r = paper_dry_run(tmp_path, "results/residualkv/tableII.csv")
    section = cfg["residualkv"]["tableII"]
    rows = sum(len(r.get("models") or section["models"]) for r in section["rows"])
    assert planned_jobs(r.stdout) == {"eval": rows * len(section["tasks"]), "rkv_mm_codec": len(section["models"]),
                                      "table": 1}
    train = f"--data-files {root}/{section['codec']['data_files'][0]} "
    assert r.stdout.count(train) == 2 and "--device cuda --dtype bfloat16 --checkpointing" in r.stdout
    assert "full_layers=0+1+2+3+10+21+29" in r.stdout   # Qwen3-VL-8B's Table I layers, its own row
    for m in section["models"]:
        assert f"--model {root}/{cfg['models'][m]['checkpoint']} " in r.stdout
    for t in section["tasks"]:
        assert f"--split {root}/{cfg['datasets'][t]['jsonl']} " in r.stdout
    assert "(local checkpoints)" not in r.stdout  # the header is the writer's, not the plan's


def test_codec_threads_are_configurable_and_outside_the_recipe(tmp_path):
    """rkv_mm_codec always trained on 1 thread; `tableII.codec.train.threads` now sets it, outside the recipe hash as
    the LM codecs' threads (Snakemake may cap the count at --cores, so a directory naming it could be false)."""
    from test_workflow import load, write_config

    cfg = load(CONFIG)
    plain = snakemake(tmp_path, "-n", "-p", "results/residualkv/tableII.csv")
    cfg["residualkv"]["tableII"]["codec"]["train"]["threads"] = 2
    two = snakemake(tmp_path, "-n", "-p", "results/residualkv/tableII.csv", "--configfile",
                    str(write_config(tmp_path / "c.yaml", cfg)))
    assert plain.returncode == 0 and two.returncode == 0, two.stdout[-3000:]
    dirs = [re.search(r"codec-train .*--out (codecs/smoke/tiny-qwen2\.5-vl/mm-[0-9a-f]{8}) .*--threads (\d) ", r.stdout)
            .groups() for r in (plain, two)]
    assert dirs[0][1] == "1" and dirs[1][1] == "2" and dirs[0][0] == dirs[1][0]


def test_full_layers_beyond_the_zoo_vlm_are_refused_in_the_dry_run(tmp_path):
    """`full_layers=0+1+30` on the 24-layer zoo VLM passed the dry run and failed in every run's first record."""
    from test_workflow import load, write_config
    from test_workflow_config_keys import _chain, _dry_run

    cfg = load(CONFIG)
    rows = cfg["residualkv"]["tableII"]["rows"]
    row = next(r for r in rows if r["label"] == "ResidualKV")
    row["method"] = row["method"].replace("full_layers=0+1", "full_layers=0+1+30")
    (tmp_path / "work").mkdir()
    with pytest.raises(Exception) as e:
        _dry_run(write_config(tmp_path / "c.yaml", cfg), ["results/residualkv/tableII.csv"], tmp_path / "work")
    assert "row 'ResidualKV' on 'tiny-qwen2.5-vl'" in _chain(e.value) and "[30]" in _chain(e.value), _chain(e.value)
    assert "24" in _chain(e.value)


def test_plan_checks_every_press_layer_by_the_press():
    """The same check for any press that names a layer (FastV's pruning layer here), not only full_layers."""
    plan = MMPlan({**SECTION, "rows": [{"label": "FastV", "method": "fastv:layer=30"}]}, "smoke", {})
    with pytest.raises(ValueError, match=r"row 'FastV' on 'tiny-qwen2.5-vl': fastv layer=30 is outside the model's 24"):
        plan.check_layers({"tiny-qwen2.5-vl": 24})
    plan.check_layers({"tiny-qwen2.5-vl": 31})
