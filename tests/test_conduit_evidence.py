"""CONDUIT Tables 14, 15 and Figure 4 (kvbench.report.conduit.evidence) on synthetic runs with audit records."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from _zoo_fixtures import write_png, write_split

from kvbench.report import tables
from kvbench.plan.conduit import ConduitPlan
from kvbench.report.conduit.accuracy import report_fig4
from kvbench.report.conduit.evidence import allocation, gap, page_tokens

L = 4                          # layers of the synthetic model
SPANS = [[10, 14], [20, 24]]   # two pages of 4 visual tokens (2x2 cells)


def _plan(tokens: list[int], coefficients=None) -> dict:
    """An audit record refreshing visual tokens ``tokens`` (0..7) at every layer."""
    depth = [L if t in tokens else 0 for t in range(8)]
    return {"image_spans": SPANS, "depth": depth, "n_layers": L, "full_prefill": False,
            "coefficients": coefficients, "per_image_refreshed": [sum(depth[:4]) / L, sum(depth[4:]) / L]}


def _cfg() -> dict:
    return {"models": ["m"], "n_test": None, "threads": 1, "reference": "full",
            "multi_image": {"K2": {"dataset": "dp", "k": [2, 2]}}, "single_image": {},
            "budgets": [0.1],
            "methods": [{"label": "Cache reuse", "method": "reuse"}, {"label": "CONDUIT", "method": "conduit"},
                        {"label": "ProphetKV", "method": "prophetkv"}, {"label": "Full prefill", "method": "full"}],
            "single_image_rows": [], "lambda": {"method": "conduit", "r": 0.1, "values": [1]},
            "ablation": [{"label": "Composite", "method": "conduit@0.1"}],
            "curve": {"methods": ["CONDUIT"], "r": [0.1]}, "gap": {"resamples": 100, "seed": 0},
            "case_study": {"column": "K2", "r": 0.1}}


def _write_runs(root: Path) -> dict:
    """8 two-page records, answer on page 1; attention gaps 0.1·i (quartiles: pairs in id order). CONDUIT refreshes
    the evidence page except on r0 and r1, raw top-k only from r4 on; CONDUIT differs from full prefill on r0 (no
    evidence token: low coverage; recovered at r = 0.2), r3 (near-tied page scores) and r5 (other)."""
    ids = [f"r{i}" for i in range(8)]
    recs = []
    for i, rid in enumerate(ids):
        content = []
        for p in (1, 2):
            content += [{"type": "text", "text": f"Page {p}:"},
                        {"type": "image", "image": "img/" + write_png(root / "img" / f"{rid}p{p}.png", 10 * i + p)}]
        recs.append({"id": rid, "kind": "vlm", "question": "Page 1, field A", "answer": "3", "content": content,
                     "meta": {"K": 2, "page": 1, "row": 1, "col": 1}})
    write_split(root / "dp.jsonl", recs)
    plan = ConduitPlan(_cfg(), "syn", zoo_models=["m"])
    attention = {rid: [1 + 0.05 * i, 1 - 0.05 * i] for i, rid in enumerate(ids)}
    conduit_coef = {rid: ([1.01, 0.99] if rid == "r3" else [1.5, 0.5]) for rid in ids}
    conduit_tok = {rid: ([4] if rid in ("r0", "r1") else [0]) for rid in ids}
    raw_tok = {rid: ([0] if int(rid[1]) >= 4 else [5]) for rid in ids}
    wrong = {"r0", "r3", "r5"}
    runs = {
        "full": lambda rid: {"prediction": "3", "score": 1.0, "plan": None},
        "reuse": lambda rid: {"prediction": "5", "score": 0.0, "plan": _plan([])},
        "conduit@0.1": lambda rid: {"prediction": "5" if rid in wrong else "3", "score": 0.0 if rid in wrong else 1.0,
                                    "plan": _plan(conduit_tok[rid], conduit_coef[rid])},
        "prophetkv@0.1": lambda rid: {"prediction": "3", "score": 1.0, "plan": _plan(raw_tok[rid])},
        "conduit@0.1:use_v_norm=false": lambda rid: {"prediction": "3", "score": 1.0,
                                                     "plan": _plan([0], attention[rid])},
        "conduit@0.2": lambda rid: {"prediction": "3" if rid != "r3" and rid != "r5" else "5", "score": 1.0,
                                    "plan": _plan([0, 1], conduit_coef[rid])},
    }
    for spec, make in runs.items():
        write_split(root / plan.run_dir("m", "dp", spec) / "predictions.jsonl",
                    [{"id": rid, "status": "ok", **make(rid)} for rid in ids])
    return {"profile": "syn", "conduit": _cfg(), "zoo_models": ["m"], "splits": {"dp": str(root / "dp.jsonl")}}


def _read(path: Path) -> tuple[list[str], pd.DataFrame]:
    lines = path.read_text().splitlines()
    return [x for x in lines if x.startswith("#")], pd.read_csv(path, comment="#")


def test_allocation_and_gap_from_an_audit_record():
    p = _plan([0, 1, 5])
    assert [list(r) for r in page_tokens(p)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert allocation(p, 0) == (pytest.approx(2 / 3), 0.5) and allocation(p, 1) == (pytest.approx(1 / 3), 0.25)
    assert gap([1.2, 0.5, 1.3], 0) == pytest.approx(-0.1) and gap(None, 0) != gap(None, 0)   # NaN
    with pytest.raises(ValueError, match="image spans cover 8"):
        page_tokens({**p, "depth": p["depth"][:7]})


def test_table14_allocation_by_quartile_and_failure_audit(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = _write_runs(tmp_path)
    tables.write("conduit/table14", json.dumps(spec), tmp_path / "t14.csv", root=tmp_path)
    header, df = _read(tmp_path / "t14.csv")
    assert "NOT the paper's numbers" in header[0] and any("low page coverage" in h for h in header)
    alloc = df[df["part"] == "allocation"].set_index("group")
    assert list(alloc.index) == ["Q1 (closest)", "Q2", "Q3", "Q4 (widest)"] and (alloc["records"] == 2).all()
    assert alloc["CONDUIT evidence share %"].tolist() == [0.0, 100.0, 100.0, 100.0]
    assert alloc["raw top-k evidence share %"].tolist() == [0.0, 0.0, 100.0, 100.0]
    assert alloc["CONDUIT - full"].tolist() == [-50.0, -50.0, -50.0, 0.0]
    assert alloc["uniform share %"].tolist() == [50.0] * 4
    audit = df[df["part"] == "audit"].set_index("group")
    assert audit.loc["differing answers", ["records", "recovered"]].tolist() == [3, 1]
    assert audit.loc["low page coverage", ["records", "recovered"]].tolist() == [1, 1]
    assert audit.loc["near-tied", ["records", "recovered"]].tolist() == [1, 0]
    assert audit.loc["other", ["records", "recovered"]].tolist() == [1, 0]


def test_table15_and_fig4_case_study(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = _write_runs(tmp_path)
    tables.write("conduit/table15", json.dumps(spec), tmp_path / "t15.csv", root=tmp_path)
    _, df = _read(tmp_path / "t15.csv")
    assert set(df["record"]) == {"r0"}   # the first record of the column in split order
    got = df.set_index("method")
    assert list(got.index) == ["Cache reuse", "CONDUIT", "ProphetKV", "Full prefill"]
    assert got["answer"].astype(str).tolist() == ["5", "5", "3", "3"] and got["correct"].tolist() == [False, False,
                                                                                                       True, True]
    assert got.loc["CONDUIT", "evidence share %"] == 0.0 and got.loc["ProphetKV", "evidence coverage %"] == 0.0
    data = report_fig4(json.dumps(spec), tmp_path / "fig4.pdf", tmp_path / "fig4.csv", root=tmp_path)
    assert (tmp_path / "fig4.pdf").read_bytes().startswith(b"%PDF")
    refreshed = data[data["depth"] > 0]
    assert set(zip(refreshed["method"], refreshed["page"], refreshed["token"])) == {("CONDUIT", 2, 0),
                                                                                   ("ProphetKV", 2, 1)}
    before = (tmp_path / "fig4.pdf").read_bytes()
    report_fig4(json.dumps(spec), tmp_path / "fig4.pdf", tmp_path / "fig4.csv", root=tmp_path)
    assert (tmp_path / "fig4.pdf").read_bytes() == before   # no timestamp in the PDF


def test_a_case_column_that_does_not_exist_is_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = _write_runs(tmp_path)
    spec["conduit"]["case_study"] = {"column": "K9"}
    with pytest.raises(ValueError, match="'K9' is not a conduit.multi_image column"):
        tables.write("conduit/table15", json.dumps(spec), tmp_path / "t15.csv", root=tmp_path)


def test_gap_quartiles_rank_by_magnitude_so_the_closest_holds_the_near_ties():
    """Review finding (issue #33): ranked by the signed gap, "Q1 (closest)" held the most negative gaps (pages a
    distractor beat by most). By |gap| it holds the near-ties, whatever their sign."""
    from kvbench.report.conduit.evidence import gap_quartiles

    gaps = pd.Series([-0.9, -0.01, 0.02, 0.5, -0.4, 0.03, 0.8, -0.02])
    q = gap_quartiles(gaps)
    assert sorted(gaps[q == "Q1 (closest)"]) == [-0.01, 0.02]
    assert sorted(gaps[q == "Q4 (widest)"]) == [-0.9, 0.8]
    assert list(gap_quartiles(pd.Series([0.3, -0.1]))) == ["Q2", "Q1 (closest)"]
