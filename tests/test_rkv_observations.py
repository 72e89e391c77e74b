"""ResidualKV Fig. 3's observations: max cosine to earlier tokens, match distance, reference residuals,
spectra (kvbench.compress.residualkv.observations), the long CSV and the figure (kvbench.report.residualkv.fig3)."""
from __future__ import annotations

import pandas as pd
import pytest
import torch
from _zoo_fixtures import text_record, write_split

from kvbench.compress.residualkv.observations import (
    ReferenceSchedule,
    cumulative_explained_variance,
    max_cosine_to_earlier,
    observe,
    reference_residuals,
)
from kvbench.report.residualkv import fig3 as rkv_fig3

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_repeated_token_has_cosine_one_at_its_gap():
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(12, 8, generator=g)
    kv[9] = 3.0 * kv[2]             # same direction as token 2, 7 tokens earlier
    cos, dist = max_cosine_to_earlier(kv)
    assert cos.shape == dist.shape == (11,)
    assert cos[8].item() == pytest.approx(1.0, abs=1e-6) and dist[8].item() == 7
    assert (cos <= 1).all() and (dist >= 1).all()  # clamped: a scaled copy rounds to 1 + 1e-7
    # token i's best match lies among tokens 0..i-1 only: token 1 can only match token 0
    assert dist[0].item() == 1


def test_a_tie_goes_to_the_earliest_token():
    cos, dist = max_cosine_to_earlier(torch.ones(6, 3))  # every earlier token matches exactly
    assert torch.equal(dist, torch.arange(1, 6)) and torch.allclose(cos, torch.ones(5))


def test_cosine_matches_a_brute_force_over_chunks(monkeypatch):
    from kvbench.compress.residualkv import observations

    monkeypatch.setattr(observations, "_CHUNK_ENTRIES", 7)  # several chunks of rows
    kv = torch.randn(20, 5, generator=torch.Generator().manual_seed(1))
    cos, dist = max_cosine_to_earlier(kv)
    xn = kv / kv.norm(dim=1, keepdim=True)
    for i in range(1, 20):
        s = xn[:i] @ xn[i]
        assert cos[i - 1].item() == pytest.approx(s.max().item(), abs=1e-6)
        assert dist[i - 1].item() == i - int(s.argmax())


def test_cosine_refuses_bad_input():
    with pytest.raises(ValueError, match=r"expected kv \[T, D\]"):
        max_cosine_to_earlier(torch.zeros(3))
    with pytest.raises(ValueError, match="finite"):
        max_cosine_to_earlier(torch.tensor([[0.0], [float("nan")]]))
    assert max_cosine_to_earlier(torch.zeros(1, 4))[0].numel() == 0


def test_residual_against_one_reference_equal_to_the_token_is_zero():
    # n_sink 0, stride 2: references at even positions; each odd token copies the reference just before it
    kv = torch.randn(10, 6, generator=torch.Generator().manual_seed(2))
    kv[1::2] = kv[0::2]
    raw, res = reference_residuals(kv, ReferenceSchedule(k=1, n_sink=0, stride=2))
    assert raw.shape == res.shape == (5, 6)
    assert torch.equal(raw, kv[1::2]) and torch.allclose(res, torch.zeros_like(res))


def test_residual_is_the_mean_of_the_k_nearest_earlier_references():
    kv = torch.randn(30, 4, generator=torch.Generator().manual_seed(3))
    sched = ReferenceSchedule(k=2, n_sink=4, stride=5)
    raw, res = reference_residuals(kv, sched)
    refs = list(range(4, 30, 5))
    coded = [p for p in range(30) if p >= 4 and p not in refs]
    assert raw.shape == (len(coded), 4)
    for row, p in enumerate(coded):
        seen = [r for r in refs if r < p]
        near = sorted(seen, key=lambda r: float(((kv[p] - kv[r]) ** 2).sum()))[:2]
        assert torch.allclose(res[row], kv[p] - kv[near].mean(0), atol=1e-5)


def test_schedule_is_checked():
    with pytest.raises(ValueError, match="k must be an integer >= 1"):
        ReferenceSchedule(k=0)
    with pytest.raises(ValueError, match="alpha must be a finite number >= 0"):
        ReferenceSchedule(alpha=-0.1)
    with pytest.raises(ValueError, match="grid must be one of"):  # the retrieval's own check: the grid too
        ReferenceSchedule(grid="dense")


def test_explained_variance_of_a_rank_one_cloud():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(50, 1, generator=g) * torch.randn(1, 6, generator=g)
    c = cumulative_explained_variance(x)
    assert c.shape == (6,) and c[0].item() == pytest.approx(1.0) and c[-1].item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="zero variance"):
        cumulative_explained_variance(torch.ones(5, 3))


@pytest.fixture(scope="module")
def lm(lm_dir):
    """The random-weight zoo LM (8 layers, K||V width 128) and its tokenizer."""
    from kvbench.models.loader import load_model

    return load_model(lm_dir)


def _splits(tmp_path):
    recs = [text_record(i) for i in range(3)]
    return {"toy": write_split(tmp_path / "toy.jsonl", recs), "toy2": write_split(tmp_path / "toy2.jsonl", recs)}


def test_observe_shapes_and_token_cap(lm, tmp_path):
    obs = observe(*lm, _splits(tmp_path), ReferenceSchedule(k=2, n_sink=2, stride=3),
                  records_per_task=2, max_tokens=70, model_name="tiny")
    assert len(obs.layers) == 8 and obs.n_tokens == 70  # the second context is cut to what is left
    assert [c["task"] for c in obs.contexts][:2] == ["toy", "toy"]
    t = obs.layers[1].tensors()
    d = 128  # K||V of the zoo LM's KV heads
    assert t["raw"].shape == t["residual"].shape and t["raw"].shape[1] == d
    assert t["cos"].numel() == obs.n_tokens - len(obs.contexts)   # every token but each context's first


def test_csv_panels_and_figure(lm, tmp_path):
    obs = observe(*lm, _splits(tmp_path), ReferenceSchedule(k=2, n_sink=2, stride=3),
                  records_per_task=1, max_tokens=200, model_name="tiny")
    df = rkv_fig3.write(obs, tmp_path / "fig3.csv", "smoke", zoo=True)
    assert set(df["panel"]) == set("abcdef") | {"summary"}
    assert set(df["layer"].astype(str)) == {"all", *map(str, range(8))}
    a = df[(df["panel"] == "a") & (df["layer"] == "all")]
    assert a["value"].sum() == pytest.approx(1.0) and a["count"].sum() == 8 * (obs.n_tokens - len(obs.contexts))
    c = df[(df["panel"] == "c") & (df["layer"] == "all") & (df["series"] == "raw")]
    assert len(c) == 128 and c["value"].is_monotonic_increasing and c["value"].iloc[-1] == pytest.approx(1.0)
    head = (tmp_path / "fig3.csv").read_text().splitlines()
    assert "tiny zoo LM" in head[0] and "headline: mean max cosine" in head[3]
    back = pd.read_csv(tmp_path / "fig3.csv", comment="#")
    assert len(back) == len(df)
    from pathlib import Path

    published = Path(__file__).resolve().parents[1] / "config" / "published" / "residualkv.yaml"
    summary = rkv_fig3.plot(tmp_path / "fig3.csv", tmp_path / "fig3.pdf", tmp_path / "fig3_summary.csv", published)
    assert (tmp_path / "fig3.pdf").read_bytes()[:4] == b"%PDF"
    pub = summary.dropna(subset=["published"]).set_index("quantity")
    import yaml

    entries = {e["id"]: e["value"] for e in yaml.safe_load(published.read_text())["entries"] if e["table"] == "fig3"}
    assert pub["published"].to_dict() == {"mean max cosine": entries["f3-max-cosine"],
                                          "best matches farther than 16 tokens %": entries["f3-far-match"]}
    assert not pub["comparable"].any() and "comparable False: the tiny zoo LM" in (tmp_path / "fig3_summary.csv").read_text()
    ours = summary.set_index(["quantity", "series"])["ours"]
    assert ours[("mean max cosine", "raw")] == pytest.approx(float(torch.cat([l.tensors()["cos"] for l in obs.layers]).mean()))


def test_plot_names_a_missing_panel(tmp_path):
    (tmp_path / "x.csv").write_text("panel,quantity,layer,series,x_lo,x_hi,count,value\nsummary,q,all,raw,,,,1\n")
    with pytest.raises(ValueError, match=r"panel\(s\) \['a', 'b', 'c', 'd', 'e', 'f'\] missing"):
        rkv_fig3.plot(tmp_path / "x.csv", tmp_path / "x.pdf", tmp_path / "s.csv")
