"""ResidualKV figures: each writes its plotted numbers to a CSV first, then the PDF from that CSV.

- Fig. 5: score vs number of references (α sweep and fixed strides at inference, main codec);
- Fig. 10: joint vs separate K/V codec at matched parameters, validation NTP loss and reconstruction vs step;
- Fig. 11: codec hyper-parameters (d_c, d_ff, k, s) vs final validation NTP loss (equal training steps) and
  relative decode throughput (``kvbench bench rkv-variants``);
- Fig. 12: training objective (NTP-only, MSE-only, joint): validation NTP and reconstruction vs step;
- Fig. 8: decode tokens/s vs context with 95% intervals, and the achieved bandwidth (from
  ``kvbench bench rkv-throughput``'s CSV);
- Fig. 6: codec cost, SwiGLU encoder + linear decoder vs the reverse (from ``kvbench bench codec-cost``).
"""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from kvbench.compress.residualkv import references  # noqa: E402
from kvbench.report.residualkv.tables import model_shape, run_summary, write_csv  # noqa: E402
from kvbench.plan.codecs import DEFAULT_VARIANT, FIG11_PANELS, FIGURE_VARIANTS
from kvbench.plan.residualkv import RKVPlan, press_spec  # noqa: E402
from kvbench.utils.io import atomic_path  # noqa: E402

SMOKE_NOTE = "tiny zoo LM trained here; not the paper's numbers"


def _save(fig, out: str | Path) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        fig.savefig(tmp, format="pdf", bbox_inches="tight", metadata={"CreationDate": None})  # same bytes on a rerun
    plt.close(fig)


def fig5(plan: RKVPlan, out: str | Path, out_csv: str | Path, root: str | Path = ".") -> pd.DataFrame:
    """Score (avg over tasks) vs references held at the mean evaluated context, one point per schedule."""
    codec = plan.codecs.config("main", model_shape(plan, root))
    rows = []
    for row in plan.rows("fig5"):
        summaries = [run_summary(Path(root) / plan.run_dir(t, row.spec)) for t in plan.tasks]
        n_tok = int(round(sum(s["n_tokens"] for s in summaries) / len(summaries)))
        schedule = press_spec(row.spec).build().schedule(codec)   # the row's inference-time stride / alpha
        kw = dict(n_sink=schedule.n_sink, stride=int(schedule.stride), alpha=float(schedule.alpha))
        rows.append({"schedule": row.label, "family": "alpha" if row.label.startswith("alpha") else "stride",
                     "context": n_tok, "references": references.reference_count(n_tok, **kw),
                     "score": round(sum(s["score"] for s in summaries) / len(summaries), 2)})
    df = pd.DataFrame(rows)
    write_csv(df, plan.header("Fig. 5 (score vs number of references)", "fig5"), out_csv)
    fig, ax = plt.subplots(figsize=(4.5, 3.2))
    for fam, d in df.groupby("family"):
        ax.plot(d["references"], d["score"], "o-", label="dynamic stride (α)" if fam == "alpha" else "fixed stride s")
        for _, r in d.iterrows():
            ax.annotate(r["schedule"].split("= ")[1], (r["references"], r["score"]), fontsize=7)
    ax.set_xlabel(f"references at {int(df['context'].mean())} tokens")
    ax.set_ylabel("score (avg over tasks)")
    ax.set_title(f"Fig. 5 (smoke): {SMOKE_NOTE}", fontsize=7)
    ax.legend(fontsize=7)
    _save(fig, out)
    return df


def _variant_file(plan: RKVPlan, variant: str, name: str, fig: str, root: str | Path) -> Path:
    """``codecs/.../<variant>-<recipe>/<name>``, or a FileNotFoundError naming the figure that needs the variant."""
    path = Path(root) / plan.codecs.dir(variant) / name
    if not path.is_file():
        raise FileNotFoundError(f"{fig} needs codec variant {variant!r}, but {path} is missing (train it: "
                                f"snakemake {plan.codecs.dir(variant)}/summary.json)")
    return path


def _summaries(plan: RKVPlan, variants: list[str], fig: str, root: str | Path) -> dict[str, dict]:
    """Each variant's training ``summary.json``. ``kvbench codec-train`` writes one only when all steps are
    done, and the plan gives a figure's variants equal steps (paper §V-C compares them at matched steps).

    Raises:
        FileNotFoundError: a variant's summary is missing.
        ValueError: a summary of an unfinished codec (``finished: false``, written by an older kvbench).
    """
    summaries = {}
    for v in variants:
        path = _variant_file(plan, v, "summary.json", fig, root)
        summary = json.loads(path.read_text())
        if summary.get("finished") is False:
            raise ValueError(f"{path}: an unfinished codec ({summary.get('steps_done')} of {summary.get('steps')} steps, "
                             f"written by an older kvbench's budget cap); {fig} compares finished codecs only: "
                             f"delete {path.parent} and rerun")
        summaries[v] = summary
    return summaries


def _curve_figure(plan, variants, labels, title, out, out_csv, root) -> pd.DataFrame:
    fig_name = title.split(" (")[0]
    summaries = _summaries(plan, variants, fig_name, root)
    frames = []
    for v in variants:
        d = pd.read_csv(_variant_file(plan, v, "curves.csv", fig_name, root))
        frames.append(d.assign(variant=v, params=summaries[v].get("codec_params")))
    df = pd.concat(frames, ignore_index=True)
    ev = df.dropna(subset=["eval_ntp"])
    write_csv(ev[["variant", "params", "step", "eval_ntp", "eval_rec", "ntp", "rec"]],
              plan.header(title) + ["# eval_*: 4 held-out windows of the corpus 'test' split"], out_csv)
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    for v in variants:
        d = ev[ev["variant"] == v]
        label = f"{labels.get(v, v)} ({int(d['params'].iloc[0]):,} params)" if len(d) else v
        axes[0].plot(d["step"], d["eval_ntp"], "o-", label=label)
        axes[1].plot(d["step"], d["eval_rec"], "o-", label=label)
    axes[0].set_ylabel("validation NTP loss")
    axes[1].set_ylabel("validation reconstruction (sum of layer MSE)")
    for ax in axes:
        ax.set_xlabel("training step")
        ax.legend(fontsize=7)
    fig.suptitle(f"{title}: {SMOKE_NOTE}", fontsize=8)
    _save(fig, out)
    return ev


def fig10(plan: RKVPlan, out, out_csv, root=".") -> pd.DataFrame:
    return _curve_figure(plan, ["base", "separate"], {"base": "joint K‖V", "separate": "separate K, V"},
                         "Fig. 10 (joint vs separate K/V codec, matched parameters)", out, out_csv, root)


def fig12(plan: RKVPlan, out, out_csv, root=".") -> pd.DataFrame:
    return _curve_figure(plan, ["ntp", "mse", "base"], {"ntp": "NTP only", "mse": "MSE only", "base": "joint"},
                         "Fig. 12 (training objective)", out, out_csv, root)


def fig11(plan: RKVPlan, out, out_csv, root=".", throughput: str | Path | None = None) -> pd.DataFrame:
    """Per hyper-parameter (d_c, d_ff, k, s): final validation NTP loss of the variant codecs (equal
    training steps) and, from ``throughput`` (``kvbench bench rkv-variants``' CSV), the decode throughput
    relative to the default setting. Without ``throughput`` the CSV says it was not measured.

    Raises:
        ValueError: ``throughput`` lacks a variant of :data:`~kvbench.plan.codecs.FIG11_PANELS`.
    """
    from kvbench.compress.residualkv.codec import CodecConfig

    summaries = _summaries(plan, FIGURE_VARIANTS["fig11"], "Fig. 11", root)
    notes = []
    rows = []
    for param, variants in FIG11_PANELS.items():
        for v in variants:
            summary = summaries[v]
            # the value the codec was trained with (its codec.json), not what the config says now
            cfg = CodecConfig.from_json(_variant_file(plan, v, "codec/codec.json", "Fig. 11", root).read_text())
            value = getattr(cfg, {"s": "stride"}.get(param, param))
            final = summary.get("eval_final") or {}
            rows.append({"parameter": param, "value": value, "variant": v, "params": summary.get("codec_params"),
                         "steps": summary["steps"], "eval_ntp": final.get("eval_ntp"),
                         "eval_rec": final.get("eval_rec"), "default": v == DEFAULT_VARIANT})
    df = pd.DataFrame(rows)
    if throughput is not None:
        tp = read_bench_csv(throughput, ["variant", "tokens_per_s", "relative_throughput"], "kvbench bench rkv-variants")
        missing = sorted(set(df["variant"]) - set(tp["variant"]))
        if missing:
            raise ValueError(f"{throughput}: no throughput row for variant(s) {missing}")
        df = df.merge(tp[["variant", "tokens_per_s", "relative_throughput"]], on="variant", how="left")
        notes.append("# relative_throughput: decode tokens/s over the default's, from " + str(throughput) + " ("
                     + Path(throughput).read_text().splitlines()[0].lstrip("# ") + ")")
    else:
        df["relative_throughput"] = float("nan")
        notes.append("# relative_throughput: not measured (no `kvbench bench rkv-variants` CSV given)")
    write_csv(df, plan.header("Fig. 11 (codec hyper-parameters vs validation NTP loss and throughput)") + notes, out_csv)
    fig, axes = plt.subplots(2, 4, figsize=(12, 5.6), squeeze=False)
    for j, (param, d) in enumerate(df.groupby("parameter", sort=False)):
        d = d.sort_values("value")
        for i, (col, label) in enumerate([("eval_ntp", "validation NTP loss"),
                                          ("relative_throughput", "relative decode throughput")]):
            ax = axes[i][j]
            ax.plot(d["value"], d[col], "o-", color="tab:blue")
            dd = d[d["default"]]
            ax.plot(dd["value"], dd[col], "o", color="red")
            ax.set_xlabel(param)
            ax.set_ylabel(label)
    fig.suptitle(f"Fig. 11 (smoke; red = default; throughput on a random-weight timing LM): {SMOKE_NOTE}", fontsize=8)
    _save(fig, out)
    return df


def read_bench_csv(path: str | Path, columns: list[str], writer: str) -> pd.DataFrame:
    """A profiling CSV, refused with a message naming the command that writes it when columns are missing
    (e.g. Fig. 8 given Fig. 6's CSV).

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: ``path`` is not a CSV with ``columns``.
    """
    try:
        df = pd.read_csv(path, comment="#")
    except pd.errors.ParserError as e:
        raise ValueError(f"{path}: not a CSV ({e})") from None
    except pd.errors.EmptyDataError:
        raise ValueError(f"{path}: empty, expected the CSV of `{writer}`") from None
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise ValueError(f"{path} lacks column(s) {missing}: expected the CSV of `{writer}` "
                         f"(columns {columns}), got columns {list(df.columns)}")
    return df


def fig8(raw_csv: str | Path, out: str | Path) -> pd.DataFrame:
    """Fig. 8 from ``kvbench bench rkv-throughput``'s CSV: decode tokens/s vs context per method with its 95%
    interval (``tps_lo95``/``tps_hi95``, the CSV header defines it), and beside it the achieved bandwidth
    (GB/s) against the machine's measured copy bandwidth (dashed). Returns the CSV's rows.

    Raises:
        ValueError: ``raw_csv`` is not ``kvbench bench rkv-throughput``'s CSV (see :func:`read_bench_csv`; an
            older CSV without the interval or bandwidth columns is refused, naming them).
    """
    df = read_bench_csv(raw_csv, ["method", "context", "tokens_per_s", "tps_lo95", "tps_hi95", "achieved_gb_s",
                                  "machine_read_gb_s", "device"], "kvbench bench rkv-throughput")
    fig, (ax, bw) = plt.subplots(1, 2, figsize=(9, 3.4))
    for method, d in df.groupby("method", sort=False):
        d = d.sort_values("context")
        ax.errorbar(d["context"], d["tokens_per_s"], yerr=[d["tokens_per_s"] - d["tps_lo95"],
                                                           d["tps_hi95"] - d["tokens_per_s"]],
                    fmt="o--" if method == "dynamic-cache-sdpa" else "o-", capsize=2, label=method)
        bw.plot(d["context"], d["achieved_gb_s"], "o-", label=method)
    bw.axhline(df["machine_read_gb_s"].median(), color="gray", linestyle=":", label="copy benchmark (read + written)")
    for a in (ax, bw):
        a.set_xscale("log", base=2)
        a.set_xlabel("context length (tokens)")
    ax.set_ylabel("decode tokens/s (batch 1), 95% interval")
    bw.set_ylabel("achieved GB/s (weights + KV read)")
    bw.set_yscale("log")
    dev = ", ".join(sorted(set(df["device"].astype(str))))
    fig.suptitle(f"Fig. 8 (timing LM, random weights, {dev}); not the paper's numbers", fontsize=8)
    ax.legend(fontsize=6)
    bw.legend(fontsize=6)
    _save(fig, out)
    return df


def fig6(raw_csv: str | Path, out: str | Path) -> pd.DataFrame:
    """Codec cost bars (prefill path, per-step restore, total) of the two codec forms.

    Raises:
        ValueError: ``raw_csv`` is not ``kvbench bench codec-cost``'s CSV (see :func:`read_bench_csv`).
    """
    df = read_bench_csv(raw_csv, ["codec", "prefill_ms", "restore_ms", "total_ms"], "kvbench bench codec-cost")
    fig, axes = plt.subplots(1, 3, figsize=(9, 3))
    for ax, col in zip(axes, ["prefill_ms", "restore_ms", "total_ms"]):
        ax.bar(df["codec"], df[col], color=["tab:blue", "tab:orange"][: len(df)])
        ax.set_ylabel(col.replace("_ms", " (ms)"))
        ax.tick_params(axis="x", labelsize=6, rotation=15)
    fig.suptitle("Fig. 6 (codec cost at matched parameters; this machine); not the paper's numbers", fontsize=8)
    _save(fig, out)
    return df


FIGURES = {"fig5": fig5, "fig10": fig10, "fig11": fig11, "fig12": fig12}
