"""CONDUIT premise diagnostics (kvbench.reuse.diagnostics, kvbench.report.conduit.diagnostics): captures and tables."""
from __future__ import annotations

import pytest
import torch
from _reuse_fixtures import prepared_request, tiny_vlm

from kvbench.reuse import adapter_for, full_prefill, scoring_pass
from kvbench.reuse.diagnostics import COLUMNS, capture


@pytest.fixture(scope="module")
def vlm(tokenizer):
    return adapter_for(*tiny_vlm(tokenizer))


@pytest.fixture(scope="module")
def req(vlm, tmp_path_factory):
    return prepared_request(vlm, tmp_path_factory.mktemp("c"), [1, 2, 3])


def test_capture_rows_are_the_scoring_pass_and_the_fresh_prefill(vlm, req):
    rows = capture(vlm, req, "r0", m=5, seed=0, layers=[0, 1])
    N = len(req.visual_index)
    assert len(rows) == 2 * N and set(rows[0]) == set(COLUMNS)
    sp = scoring_pass(vlm, req)
    fresh = full_prefill(vlm, req)
    vis = req.visual_index
    for layer in (0, 1):
        mine = [r for r in rows if r["layer"] == layer]
        assert [r["token"] for r in mine] == list(range(N))
        assert torch.allclose(torch.tensor([r["attn"] for r in mine]), sp.attn[layer])
        v_c = req.stale_v[layer][0][:, vis].transpose(0, 1).reshape(N, -1)
        v_f = fresh.values[layer][0][:, vis].transpose(0, 1).reshape(N, -1)
        assert torch.allclose(torch.tensor([r["vnorm_cached"] for r in mine]), v_c.norm(dim=-1))
        assert torch.allclose(torch.tensor([r["drift_sq"] for r in mine]), ((v_f - v_c) ** 2).sum(-1), rtol=1e-5)
        assert [r["image"] for r in mine] == req.image_of_visual.tolist()
    # layer 0's K/V do not depend on the prefix: a cached value equals the fresh one there
    assert max(r["drift_sq"] for r in rows if r["layer"] == 0) < 1e-8
    assert max(r["drift_sq"] for r in rows if r["layer"] == 1) > 1e-6


def test_monte_carlo_drift_is_unbiased_and_seeded(vlm, req):
    a = capture(vlm, req, "r0", m=5, seed=0, layers=[1])
    assert a == capture(vlm, req, "r0", m=5, seed=0, layers=[1])
    assert a != capture(vlm, req, "r0", m=5, seed=1, layers=[1])
    # with many directions the estimate converges to ||delta||^2
    many = capture(vlm, req, "r0", m=4000, seed=0, layers=[1])
    for r in many:
        assert r["drift_mc"] == pytest.approx(r["drift_sq"], rel=0.15)


def test_capture_names_bad_input(vlm, req):
    with pytest.raises(ValueError, match="m \\(Monte Carlo"):
        capture(vlm, req, "r0", m=0)
    with pytest.raises(ValueError, match="layers must be"):
        capture(vlm, req, "r0", layers=[vlm.n_layers])


# --- the tables, on synthetic captures -------------------------------------------------------------

def _synthetic(records: int = 20, n: int = 20, layers=(1, 2), seed: int = 0, scale: float = 1.0,
               model: str = "m", dataset: str = "docpages"):
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(seed)
    rows = []
    for r in range(records):
        for layer in layers:
            attn = rng.dirichlet(np.ones(n)) * scale
            v = rng.uniform(1, 3, n)
            drift = (v * rng.uniform(0.5, 1.5, n)) ** 2     # staleness grows with |V|: the premise holds
            for t in range(n):
                rows.append({"model": model, "dataset": dataset, "k": 2, "evidence_image": 0, "record": f"{dataset}{r}",
                             "layer": layer, "token": t, "image": t * 2 // n, "attn": attn[t], "vnorm_cached": v[t],
                             "vnorm_fresh": 2 * v[t] + 0.01 * rng.standard_normal(), "knorm_cached": rng.uniform(1, 2),
                             "drift_sq": drift[t], "drift_mc": drift[t]})
    return pd.DataFrame(rows)


def test_table11_orders_the_rules_as_the_objective_says():
    from kvbench.report.conduit.diagnostics import table11

    t = table11(_synthetic(), [1, 2], [0.1, 0.5])
    assert len(t) == 4 and (t["records"] == 20).all()
    for _, row in t.iterrows():
        best = max(row[f"{rule}_x"] for rule in ("attention", "value_norm", "key_norm", "conduit"))
        assert row["oracle_x"] >= best - 1e-9          # nothing beats the oracle of its own objective
        assert row["attention_x"] > 1.5 and row["conduit_x"] > 1.5   # attention carries alpha^2
        assert 0.7 < row["key_norm_x"] < 1.4            # an independent signal is about random
        assert 0.5 < row["spearman_surrogate"] <= 1
    import pytest as _pytest
    with _pytest.raises(ValueError, match="no capture rows at layer 7"):
        table11(_synthetic(), [7], [0.1])


def test_table12_stability_and_independent_overlap():
    from kvbench.report.conduit.diagnostics import table12

    t = table12(_synthetic(records=40), [1])
    mean = t[t["layer"] == "mean"].iloc[0]
    assert mean["vnorm_spearman"] > 0.99   # fresh = 2 x cached (+ tiny noise): same ranking
    row = t[t["layer"] == 1].iloc[0]
    for col in ("overlap_attention_key_norm", "overlap_attention_low_value_norm", "overlap_key_norm_low_value_norm"):
        assert 0.2 < row[col] < 2.5           # independent signals: near the k^2/N expectation


def test_table12_mean_leaves_out_layer_0():
    """Review finding (issue #33): the 'mean' row averaged layer 0 in, where cached = fresh (Spearman 1 by
    construction)."""
    import numpy as np

    from kvbench.report.conduit.diagnostics import table12

    df = _synthetic(records=10, layers=(0, 1))
    rng = np.random.default_rng(3)
    at1 = df["layer"] == 1
    df.loc[at1, "vnorm_fresh"] = rng.uniform(1, 3, int(at1.sum()))    # layer 1: no stability
    t = table12(df, [0, 1]).set_index("layer")
    assert t.loc[0, "vnorm_spearman"] > 0.99 and abs(t.loc[1, "vnorm_spearman"]) < 0.3
    assert t.loc["mean", "vnorm_spearman"] == t.loc[1, "vnorm_spearman"]


def test_table13_normalising_by_the_image_scale_removes_a_pure_scale_difference():
    import pandas as pd

    from kvbench.report.conduit.diagnostics import table13

    df = pd.concat([_synthetic(seed=1, dataset="docpages"), _synthetic(seed=2, scale=10.0, dataset="digitgrid")])
    t = table13(df, [1, 2], {"docpages": "page", "digitgrid": "grid"})
    all_layers = t[t["layer"] == "all"].iloc[0]
    assert all_layers["ks_raw"] > 0.5 and all_layers["ks_normalised"] < 0.1
    import pytest as _pytest
    with _pytest.raises(ValueError, match="needs two"):
        table13(_synthetic(), [1], {"docpages": "page"})


def test_the_table_writer_labels_zoo_numbers_and_regimes(tmp_path):
    import pandas as pd

    from kvbench.report.tables import write

    path = tmp_path / "cap.csv"
    pd.concat([_synthetic(dataset="docpages"), _synthetic(seed=3, dataset="digitgrid")]).to_csv(path, index=False)
    spec = {"profile": "smoke", "captures": [str(path)], "regimes": {"m": "strong"}, "zoo_models": ["m"],
            "conduit_diagnostics": {"layers": [1, 2], "budgets": [0.1], "datasets": {"docpages": "page",
                                                                                       "digitgrid": "grid"}}}
    for key in ("table11", "table12", "table13"):
        out = tmp_path / f"{key}.csv"
        df = write(f"conduit/{key}", spec, out)
        text = out.read_text()
        assert text.startswith("# CONDUIT Table 1") and "NOT the paper's numbers" in text.splitlines()[0]
        assert (df["regime"] == "strong").all()
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    import pytest as _pytest
    with _pytest.raises(ValueError, match="not a diagnostics capture"):
        write("conduit/table11", {**spec, "captures": [str(bad)]}, tmp_path / "x.csv")
