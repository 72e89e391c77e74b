"""ResidualKV Fig. 3 (observations, §III): the data of every panel as one long CSV, then the figure.

``results/residualkv/fig3.csv`` (``kvbench analyze rkv-observations``, from
:func:`kvbench.compress.residualkv.observations.observe`), one row per plotted number, columns :data:`COLUMNS`:

- ``panel`` ``a``: histogram of each token's max cosine similarity to an earlier token (``x_lo``/``x_hi`` the bin,
  ``count`` tokens, ``value`` their share); ``b``: histogram of the distance to that best match (log-spaced integer
  bins, ``[x_lo, x_hi)`` tokens); ``c``: cumulative explained variance (``value``) of the first ``x_lo`` principal
  components, raw vs residual (``layer`` ``all``: the mean of the per-layer curves); ``d``/``e``/``f``: histograms
  of per-token L2 norms, of values, of per-token extremes (max |x|), raw vs residual over the coded tokens;
- ``panel`` ``summary``: the headline numbers (``quantity``, ``value``): mean max cosine, share of best matches
  farther than 16 tokens, components for 90% of the variance, mean norms and extremes;
- ``layer``: a layer index, or ``all`` (histograms: tokens of every layer pooled).

``results/residualkv/fig3_summary.csv`` (:func:`plot`): the two headline numbers beside the paper's
(``config/published/residualkv.yaml``, entries of ``fig3``), and the other summary numbers, which the paper only
plots.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from kvbench.compress.residualkv.observations import (
    Observations,
    cumulative_explained_variance,
)
from kvbench.utils.io import write_csv

COLUMNS = ["panel", "quantity", "layer", "series", "x_lo", "x_hi", "count", "value"]
#: Distance (tokens) beyond which the paper counts a best match as far (Fig. 3(b): 59.7% beyond 16).
FAR = 16
#: Share of the variance whose component count the summary gives.
VARIANCE_SHARE = 0.9
QUANTITIES = {"a": "max cosine similarity to an earlier token", "b": "distance to the best-matching earlier token",
              "c": "cumulative explained variance", "d": "per-token L2 norm", "e": "value",
              "f": "per-token max |value|"}
#: Our summary quantity answering each published metric of ``fig3`` (config/published/residualkv.yaml).
PUBLISHED_METRICS = {"mean max cosine similarity to history": "mean max cosine",
                     "best matches farther than 16 tokens": f"best matches farther than {FAR} tokens %"}


def _hist(rows: list, panel: str, layer: str, series: str, x: torch.Tensor, edges: np.ndarray) -> None:
    counts, _ = np.histogram(x.numpy().ravel(), bins=edges)
    total = max(1, int(counts.sum()))
    for lo, hi, n in zip(edges[:-1], edges[1:], counts):
        rows.append({"panel": panel, "quantity": QUANTITIES[panel], "layer": layer, "series": series,
                     "x_lo": float(lo), "x_hi": float(hi), "count": int(n), "value": n / total})


def _edges(lo: float, hi: float, n: int) -> np.ndarray:
    return np.linspace(lo, hi if hi > lo else lo + 1.0, n + 1)


def _summary(rows: list, layer: str, quantity: str, series: str, value: float) -> None:
    rows.append({"panel": "summary", "quantity": quantity, "layer": layer, "series": series, "x_lo": None,
                 "x_hi": None, "count": None, "value": value})


def observations_frame(obs: Observations) -> pd.DataFrame:
    """The long table of every panel (module docstring) from :func:`~.observations.observe`'s result.

    Raises:
        ValueError: no coded token (every analysed token a sink or reference) or no token with an earlier one.
    """
    per = [layer.tensors() for layer in obs.layers]
    if any(t["raw"].shape[0] < 2 for t in per) or any(t["cos"].numel() == 0 for t in per):
        raise ValueError(f"too few tokens ({obs.n_tokens}) for Fig. 3: every layer needs 2 coded tokens (neither "
                         f"sinks nor references; {obs.schedule.describe()}); raise max_tokens")
    pooled = {k: torch.cat([t[k] for t in per]) for k in ("cos", "dist")}
    feats = [{s: {"d": t[s].norm(dim=1), "e": t[s], "f": t[s].abs().amax(dim=1)} for s in ("raw", "residual")}
             for t in per]
    edges = {"a": _edges(max(-1.0, math.floor(float(pooled["cos"].min()) * 10) / 10), 1.0, 50),
             "b": np.unique(np.round(np.geomspace(1, int(pooled["dist"].max()) + 1, 30))).astype(float)}
    if len(edges["b"]) < 2:
        edges["b"] = np.array([1.0, 2.0])
    for p in "def":
        vals = [f[s][p] for f in feats for s in f]
        lo = 0.0 if p != "e" else min(float(v.min()) for v in vals)
        edges[p] = _edges(lo, max(float(v.max()) for v in vals), 60 if p != "e" else 80)
    rows: list[dict] = []
    layers = [(str(i), t, f) for i, (t, f) in enumerate(zip(per, feats))]
    all_feats = {s: {p: torch.cat([f[s][p].reshape(-1) for f in feats]) for p in "def"} for s in ("raw", "residual")}
    for name, t, f in [("all", pooled, all_feats), *layers]:
        _hist(rows, "a", name, "raw", t["cos"], edges["a"])
        _hist(rows, "b", name, "raw", t["dist"].to(torch.float64), edges["b"])
        for s in ("raw", "residual"):
            for p in "def":
                _hist(rows, p, name, s, f[s][p], edges[p])
        _summary(rows, name, "mean max cosine", "raw", float(t["cos"].mean()))
        _summary(rows, name, f"best matches farther than {FAR} tokens %", "raw",
                 100.0 * float((t["dist"] > FAR).double().mean()))
        _summary(rows, name, "median distance to the best match", "raw", float(t["dist"].double().median()))
        for s in ("raw", "residual"):
            _summary(rows, name, "mean L2 norm", s, float(f[s]["d"].mean()))
            _summary(rows, name, "mean per-token max |value|", s, float(f[s]["f"].mean()))
            _summary(rows, name, "std of values", s, float(f[s]["e"].double().std()))
    curves = {s: [cumulative_explained_variance(t[s]) for t in per] for s in ("raw", "residual")}
    for s, cs in curves.items():
        for name, c in [("all", torch.stack(cs).mean(0)), *((str(i), c) for i, c in enumerate(cs))]:
            for n, v in enumerate(c.tolist(), start=1):
                rows.append({"panel": "c", "quantity": QUANTITIES["c"], "layer": name, "series": s, "x_lo": n,
                             "x_hi": n, "count": None, "value": v})
            _summary(rows, name, f"components for {VARIANCE_SHARE:.0%} of the variance", s,
                     int((c < VARIANCE_SHARE - 1e-12).sum()) + 1)
    return pd.DataFrame(rows, columns=COLUMNS)


def header(obs: Observations, profile: str, zoo: bool) -> list[str]:
    """The ``#`` lines of ``fig3.csv``: what was analysed (model, contexts, tokens, layers, schedule)."""
    tasks = sorted({c["task"] for c in obs.contexts})
    what = ("tiny zoo LM trained here, not the paper's model (Qwen2.5-7B-Instruct-1M); not the paper's numbers"
            if zoo else "local checkpoint; computed by this pipeline, not copied from the paper")
    d = obs.layers[0].tensors()["raw"].shape[1] if obs.layers else 0
    return [f"# kvbench ResidualKV Fig. 3 (observations of pre-RoPE K||V), profile {profile!r}: model {obs.model} ({what})",
            f"# contexts: {len(obs.contexts)} ({', '.join(tasks)}: the first records' contexts of each test split), "
            f"{obs.n_tokens} tokens; layers: all {len(obs.layers)} (layer 'all': pooled, or the mean curve in panel c), "
            f"K||V width {d}",
            f"# residual: kv minus the mean of its {obs.schedule.describe()} (the codec's input); raw vs residual "
            "over the coded tokens (neither sinks nor references); cosine and distance over every token after the "
            "first of its context, to earlier tokens of the same context"]


def write(obs: Observations, out: str | Path, profile: str, zoo: bool) -> pd.DataFrame:
    """Write ``fig3.csv`` (:func:`observations_frame` under :func:`header`), atomically; returns the frame."""
    df = observations_frame(obs)
    s = df[(df["panel"] == "summary") & (df["layer"] == "all")].set_index("quantity")["value"]
    lines = header(obs, profile, zoo) + [
        f"# headline: mean max cosine {s['mean max cosine']:.3f}; best matches farther than {FAR} tokens "
        f"{s[f'best matches farther than {FAR} tokens %']:.1f}% (all layers pooled)"]
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    write_csv(df, lines, str(out))
    return df


def summary_frame(df: pd.DataFrame, published: str | Path | None, comparable: bool = True) -> pd.DataFrame:
    """The headline numbers (layer ``all``) with the paper's beside the two it gives (``published``: the paper's
    published-figures file; None: no published column); ``comparable`` False (the tiny zoo LM, not the paper's
    checkpoint) marks the differences as meaningless in absolute terms."""
    ours = df[(df["panel"] == "summary") & (df["layer"].astype(str) == "all")]
    pub: dict[str, tuple] = {}
    if published is not None:
        from kvbench.report.published import load_published

        p = load_published(published)
        for e in p.for_table("fig3"):
            if e.kind == "value" and e.metric in PUBLISHED_METRICS:
                pub[PUBLISHED_METRICS[e.metric]] = (e.value, e.backbone, p.source(e))
    rows = []
    for _, r in ours.iterrows():
        v, backbone, source = pub.get(r["quantity"], (None, "", "")) if r["series"] == "raw" else (None, "", "")
        rows.append({"quantity": r["quantity"], "series": r["series"], "ours": r["value"], "published": v,
                     "published_backbone": backbone, "diff": None if v is None else r["value"] - v,
                     "comparable": comparable if v is not None else None,
                     "source": source, "reason": "" if v is not None else "the paper only plots it (no number)"})
    return pd.DataFrame(rows)


def plot(data: str | Path, out: str | Path, summary_out: str | Path, published: str | Path | None = None) -> pd.DataFrame:
    """Fig. 3's six panels from ``fig3.csv`` (layer ``all``) into ``out`` (PDF), and :func:`summary_frame` into
    ``summary_out`` (under the data's header); returns the summary.

    Raises:
        FileNotFoundError: ``data`` is missing.
        ValueError: ``data`` lacks a panel.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvbench.report.residualkv.figures import _save

    head = [ln.rstrip("\n") for ln in Path(data).read_text(encoding="utf-8").splitlines() if ln.startswith("#")]
    df = pd.read_csv(data, comment="#")
    missing = sorted(set("abcdef") - set(df["panel"]))
    if missing:
        raise ValueError(f"{data}: panel(s) {missing} missing (written by kvbench analyze rkv-observations?)")
    d = df[df["layer"].astype(str) == "all"]
    zoo = any("tiny zoo" in line for line in head)
    summary = summary_frame(df, published, comparable=not zoo)
    write_csv(summary, head + ["# Fig. 3 headline numbers (layer 'all'); published: the paper's, where it gives one"
                               + ("; comparable False: the tiny zoo LM on smoke contexts, not the paper's checkpoint "
                                  "and texts, so the differences are not the paper's" if zoo else "")],
              str(summary_out))
    s = summary[summary["series"] == "raw"].set_index("quantity")["ours"]
    fig, axes = plt.subplots(2, 3, figsize=(12, 6.5))
    colours = {"raw": "tab:blue", "residual": "tab:orange"}

    def bars(ax, panel, series, log_y=False):
        for name in series:
            h = d[(d["panel"] == panel) & (d["series"] == name)]
            ax.stairs(h["value"].to_numpy(), np.append(h["x_lo"].to_numpy(), h["x_hi"].to_numpy()[-1]),
                      fill=len(series) == 1, alpha=0.6, color=colours[name], label=name)
        ax.set_xlabel(QUANTITIES[panel])
        ax.set_ylabel("share of tokens" if panel in "abdf" else "share of values")
        if log_y:
            ax.set_yscale("log")
        if len(series) > 1:
            ax.legend(fontsize=7)

    bars(axes[0, 0], "a", ["raw"])
    axes[0, 0].axvline(s["mean max cosine"], color="k", ls="--", lw=1)
    axes[0, 0].set_title(f"(a) mean {s['mean max cosine']:.3f}", fontsize=9)
    bars(axes[0, 1], "b", ["raw"])
    axes[0, 1].set_xscale("log")
    axes[0, 1].axvline(FAR + 1, color="k", ls="--", lw=1)
    far = s[f"best matches farther than {FAR} tokens %"]
    axes[0, 1].set_title(f"(b) {far:.1f}% farther than {FAR} tokens", fontsize=9)
    for name in ("raw", "residual"):
        c = d[(d["panel"] == "c") & (d["series"] == name)]
        axes[0, 2].plot(c["x_lo"], c["value"], color=colours[name], label=name)
    axes[0, 2].set_xlabel("principal components")
    axes[0, 2].set_ylabel("cumulative explained variance")
    axes[0, 2].set_title("(c) mean over layers", fontsize=9)
    axes[0, 2].legend(fontsize=7)
    for ax, p, title in ((axes[1, 0], "d", "(d) norms"), (axes[1, 1], "e", "(e) values"), (axes[1, 2], "f", "(f) extremes")):
        bars(ax, p, ["raw", "residual"], log_y=p != "d")
        ax.set_title(title, fontsize=9)
    fig.suptitle(head[0].removeprefix("# ")[:160], fontsize=7)
    fig.tight_layout()
    _save(fig, out)
    return summary
