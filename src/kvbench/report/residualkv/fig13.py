"""ResidualKV Fig. 13 (visual case, §V-E): the references of one image's visual tokens, as a CSV and a figure.

``results/residualkv/fig13.csv`` (``kvbench analyze rkv-visual-case``, from
:func:`kvbench.compress.residualkv.visual_case.visual_case`), columns :data:`COLUMNS`: one row per (layer, visual token
of the drawn image, reference rank) for the tokens the cache codes, and one row (``rank`` empty) per visual token it
keeps raw (``stored_as`` ``reference``: in the FP8 pool itself; ``sink``). A coded token with no earlier reference to
pick (none visible yet) has no row, so ``visual_tokens`` in the summary counts the tokens with a row. A reference's ``ref_kind``: ``patch`` (a
visual token of the same image: ``ref_row``/``ref_col``), ``other_image`` (a visual token of another image of the
prompt), ``text`` (any other token: system prompt, captions, ``<|vision_start|>``), ``sink`` (position < n_sink; the
cache never pools them, so only another schedule could give one). ``sq_l2`` is the codec's ranking (squared L2 to the
reference as stored), ``cosine`` beside it; ``patch_distance`` the Euclidean distance in merged patches (``patch``
only); ``visible_refs`` / ``visible_patch_refs`` the pool entries the token could pick from (all / patches of its
image), the chance level of a pick.

``results/residualkv/fig13_summary.csv`` (:func:`plot`): per layer and over all drawn layers (``all``; the token
counts are the image's, the same in every layer; ``references`` and the shares pool the layers), the share of
the references that are patches of the image, of other images, text and sinks, the share chance would give
(``chance_patch``: mean over coded tokens of visible patch references / visible references), mean patch and token
distances, mean cosine. The paper gives no number for Fig. 13 (qualitative), so there is no published column.
"""
from __future__ import annotations

import math
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd

from kvbench.compress.residualkv.visual_case import VisualCase
from kvbench.utils.io import read_jsonl, write_csv

COLUMNS = ["record", "layer", "position", "image", "frame", "row", "col", "stored_as", "rank", "ref_position",
           "ref_kind", "ref_image", "ref_frame", "ref_row", "ref_col", "ref_token", "token_distance", "patch_distance",
           "sq_l2", "cosine", "visible_refs", "visible_patch_refs"]
INT_COLUMNS = ["rank", "ref_position", "ref_image", "ref_frame", "ref_row", "ref_col", "token_distance", "visible_refs",
               "visible_patch_refs"]
KINDS = ("patch", "other_image", "text", "sink")
SUMMARY_COLUMNS = ["layer", "visual_tokens", "stored_as_reference", "stored_as_sink", "coded", "references",
                   "share_patch", "share_other_image", "share_text", "share_sink", "chance_patch", "nearest_is_patch",
                   "mean_patch_distance", "mean_token_distance", "mean_cosine"]


def _token(s: str) -> str:
    # read back with comment="#": a '#' inside a token string would cut the row
    return s.replace("#", "%23")


def case_frame(case: VisualCase) -> pd.DataFrame:
    """The rows of ``fig13.csv`` (module docstring) for the image ``case.image`` of ``case``."""
    n_sink = case.schedule.refs.n_sink
    vis = case.visual.tolist()
    where = {p: i for i, p in enumerate(vis)}         # position -> visual ordinal
    coords = case.coords.tolist()
    mine = [p for p, c in zip(vis, coords) if c[0] == case.image]
    rows: list[dict] = []
    for layer, t in case.layers.items():
        pool = set(t.ref_positions.tolist())
        row_of = {p: i for i, p in enumerate(t.positions.tolist())}
        pool_sorted = t.ref_positions
        patch_pool = pool_sorted[[where.get(p, -1) >= 0 and coords[where[p]][0] == case.image
                                  for p in pool_sorted.tolist()]] if len(pool_sorted) else pool_sorted
        for p in mine:
            img, frame, r, c = coords[where[p]]
            base = {"record": case.record, "layer": layer, "position": p, "image": img, "frame": frame, "row": r,
                    "col": c}
            if p < n_sink or p in pool:
                rows.append({**base, "stored_as": "sink" if p < n_sink else "reference"})
                continue
            i = row_of[p]
            visible = int((pool_sorted < p).sum())
            visible_patch = int((patch_pool < p).sum())
            for rank in range(int(t.valid[i].sum())):
                q = int(t.refs[i, rank])
                ref = {"ref_position": q, "ref_token": _token(case.tokens[q]), "token_distance": p - q}
                if q in where:
                    qi, qf, qr, qc = coords[where[q]]
                    ref.update(ref_kind="patch" if qi == img else "other_image", ref_image=qi, ref_frame=qf,
                               ref_row=qr, ref_col=qc)
                    if qi == img:
                        ref["patch_distance"] = math.hypot(qr - r, qc - c)
                else:
                    ref["ref_kind"] = "sink" if q < n_sink else "text"
                rows.append({**base, "stored_as": "coded", "rank": rank + 1, **ref,
                             "sq_l2": float(t.sq_dist[i, rank]), "cosine": float(t.cosine[i, rank]),
                             "visible_refs": visible, "visible_patch_refs": visible_patch})
    df = pd.DataFrame(rows, columns=COLUMNS)
    return df.astype({c: "Int64" for c in INT_COLUMNS})   # integers with gaps (a raw token has no reference)


def header(case: VisualCase, profile: str, zoo: bool) -> list[str]:
    """The ``#`` lines of ``fig13.csv``: what ran (model, record, image and its grid, layers, schedule)."""
    what = ("tiny zoo VLM trained here, not the paper's models (Qwen3-VL-8B, LLaVA-OV-7B); smoke image, not the "
            "paper's photographs" if zoo else "local checkpoint; computed by this pipeline, not copied from the paper")
    t, h, w = case.grids[case.image]
    return [f"# kvbench ResidualKV Fig. 13 (visual case: references of visual tokens), profile {profile!r}: model "
            f"{case.model} ({what})",
            f"# record {case.record!r} of {case.task or 'the split'}, image {case.image} of {len(case.grids)}: merged "
            f"patch grid t x h x w = {t} x {h} x {w} (row-major), {case.n_tokens} prompt tokens; layers "
            f"{list(case.layers)}",
            f"# references as the ResidualKV cache stores them: {case.schedule.describe()}; each coded token's k "
            "nearest references at earlier positions by squared L2 (the pool: positions >= n_sink on the stride "
            "grid; sinks stay raw); ref_token: '#' written as %23"]


def write(case: VisualCase, out: str | Path, profile: str, zoo: bool) -> pd.DataFrame:
    """Write ``fig13.csv`` (:func:`case_frame` under :func:`header`), atomically; returns the frame.

    Raises:
        ValueError: the drawn image has no coded visual token (every one a sink or reference: nothing to draw).
    """
    df = case_frame(case)
    if not (df["stored_as"] == "coded").any():
        raise ValueError(f"record {case.record!r}, image {case.image}: none of its visual tokens is coded (all sinks or "
                         f"references under {case.schedule.refs.describe()}); pick a larger image")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    write_csv(df, header(case, profile, zoo), str(out))
    return df


def _summary_row(layer: str, d: pd.DataFrame) -> dict:
    tokens = d.drop_duplicates("position")   # how a token is stored depends on its position only, not the layer
    coded = d[d["stored_as"] == "coded"]
    first = coded[coded["rank"] == 1]
    n = len(coded)
    share = {k: (coded["ref_kind"] == k).mean() if n else float("nan") for k in KINDS}
    return {"layer": layer, "visual_tokens": len(tokens), "stored_as_reference": int((tokens["stored_as"] == "reference").sum()),
            "stored_as_sink": int((tokens["stored_as"] == "sink").sum()),
            "coded": int((tokens["stored_as"] == "coded").sum()), "references": n,
            **{f"share_{k}": share[k] for k in KINDS},
            "chance_patch": (first["visible_patch_refs"] / first["visible_refs"]).mean() if len(first) else float("nan"),
            "nearest_is_patch": (first["ref_kind"] == "patch").mean() if len(first) else float("nan"),
            "mean_patch_distance": coded["patch_distance"].mean(), "mean_token_distance": coded["token_distance"].mean(),
            "mean_cosine": coded["cosine"].mean()}


def summary_frame(df: pd.DataFrame) -> pd.DataFrame:
    """Per drawn layer and ``all`` (every drawn layer pooled): :data:`SUMMARY_COLUMNS` (module docstring)."""
    rows = [_summary_row(str(layer), d) for layer, d in df.groupby("layer", sort=True)]
    rows.append(_summary_row("all", df))
    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS)


def image_of(split: str | Path, record: str, image: int):
    """The ``image``-th image (0-based, prompt order) of record ``record`` in the JSONL ``split``, as an RGB PIL image.

    Raises:
        ValueError: no record with that id, or it has no such image.
    """
    from kvbench.models.prompting import load_image

    recs = [r for r in read_jsonl(split) if str(r.get("id")) == str(record)]
    if not recs:
        raise ValueError(f"{split}: no record with id {record!r} (the split fig13.csv was made from?)")
    images = [part["image"] for part in recs[0].get("content", []) if part.get("type") == "image"]
    if not 0 <= image < len(images):
        raise ValueError(f"{split}: record {record!r} has {len(images)} image(s), not an image {image}")
    return load_image(images[image], Path(split).parent)


def query_tokens(df: pd.DataFrame, n: int) -> list[int]:
    """Positions of ``n`` coded visual tokens, evenly spaced in prompt order (first and last included), the queries
    drawn with their references: the same in every layer (which tokens are coded depends on positions only).

    Raises:
        ValueError: ``n`` below 1.
    """
    if n < 1:
        raise ValueError(f"queries must be >= 1, got {n}")
    coded = sorted(df.loc[df["stored_as"] == "coded", "position"].unique().tolist())
    if len(coded) <= n:
        return coded
    return [coded[int(round(i))] for i in np.linspace(0, len(coded) - 1, n)]


def plot(data: str | Path, split: str | Path, out: str | Path, summary_out: str | Path, queries: int = 4) -> pd.DataFrame:
    """Fig. 13 from ``fig13.csv``: per drawn layer, (top) the image with its merged patch grid, ``queries`` query
    patches (:func:`query_tokens`, a red T each) and a line to each of their patch references (a count for text and
    other-image references), the patches stored as references outlined; (bottom) the per-patch map of the distance in
    patches to each coded token's nearest reference (grey with a label where that is not a patch of the image: ``txt``,
    ``img``, ``snk``; ``R`` a reference, ``S`` a sink). Writes :func:`summary_frame` into ``summary_out`` under the data's
    header; returns it.

    Raises:
        FileNotFoundError: ``data`` or ``split`` is missing.
        ValueError: ``data`` has no coded visual token, or its record is not in ``split``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvbench.report.residualkv.figures import _save

    head = [ln.rstrip("\n") for ln in Path(data).read_text(encoding="utf-8").splitlines() if ln.startswith("#")]
    df = pd.read_csv(data, comment="#")
    if not (df["stored_as"] == "coded").any():
        raise ValueError(f"{data}: no coded visual token (written by kvbench analyze rkv-visual-case?)")
    summary = summary_frame(df)
    write_csv(summary, head + ["# Fig. 13 summary per drawn layer ('all': pooled): shares of the visual tokens' "
                               "references by kind, the patch share a uniform pick among the visible references would "
                               "give (chance_patch), distances; the paper's Fig. 13 is qualitative (no published number)"],
              str(summary_out))
    record, image = str(df["record"].iloc[0]), int(df["image"].iloc[0])
    img = image_of(split, record, image)
    h, w = int(df["row"].max()) + 1, int(df["col"].max()) + 1
    layers = sorted(df["layer"].unique().tolist())
    picks = query_tokens(df, queries)
    # the queries' arrow colours: tab10 without its red, which marks the query patches (the paper's red T)
    colours = [c for i, c in enumerate(plt.get_cmap("tab10").colors) if i != 3]
    fig, axes = plt.subplots(2, len(layers), figsize=(3.4 * len(layers), 7.0), squeeze=False)
    for j, layer in enumerate(layers):
        d = df[df["layer"] == layer]
        s = summary[summary["layer"] == str(layer)].iloc[0]
        ax = axes[0, j]
        ax.imshow(np.asarray(img), extent=(0, w, h, 0), interpolation="nearest")
        ax.set_xticks(range(w + 1), minor=True), ax.set_yticks(range(h + 1), minor=True)
        ax.grid(which="minor", color="white", lw=0.5, alpha=0.7)
        ax.tick_params(which="both", length=0, labelsize=6)
        for _, r in d[d["stored_as"] == "reference"].iterrows():
            ax.add_patch(plt.Rectangle((r["col"], r["row"]), 1, 1, fill=False, ec="black", lw=1.5))
        for qi, p in enumerate(picks):
            refs = d[(d["position"] == p) & (d["stored_as"] == "coded")].sort_values("rank")
            colour = colours[qi % len(colours)]
            qx, qy = refs["col"].iloc[0] + 0.5, refs["row"].iloc[0] + 0.5
            for _, r in refs[refs["ref_kind"] == "patch"].iterrows():
                ax.annotate("", xy=(r["ref_col"] + 0.5, r["ref_row"] + 0.5), xytext=(qx, qy),
                            arrowprops=dict(arrowstyle="->", color=colour, lw=2.0 - 0.3 * (r["rank"] - 1), alpha=0.9))
            ax.text(qx, qy, "T", color="red", ha="center", va="center", fontsize=10, fontweight="bold")
            rest = refs[refs["ref_kind"] != "patch"]["ref_kind"].value_counts()
            if len(rest):
                label = " ".join(f"+{n} {k.replace('other_image', 'img').replace('text', 'txt')}" for k, n in rest.items())
                ax.text(qx, qy + 0.32, label, color=colour, ha="center", va="top", fontsize=5.5,
                        bbox=dict(fc="white", ec="none", alpha=0.7, pad=0.5))
        ax.set_xlim(0, w), ax.set_ylim(h, 0)
        ax.set_title(f"layer {layer}: {s['share_patch']:.0%} of refs are patches (chance {s['chance_patch']:.0%})",
                     fontsize=7)
        grid = np.full((h, w), np.nan)
        labels: dict[tuple[int, int], str] = {}
        for _, r in d.drop_duplicates("position").iterrows():
            cell = (int(r["row"]), int(r["col"]))
            if r["stored_as"] != "coded":
                labels[cell] = "R" if r["stored_as"] == "reference" else "S"
                continue
            first = d[(d["position"] == r["position"]) & (d["rank"] == 1)].iloc[0]
            if first["ref_kind"] == "patch":
                grid[cell] = first["patch_distance"]
                labels[cell] = f"{first['patch_distance']:.1f}"
            else:
                labels[cell] = {"text": "txt", "other_image": "img", "sink": "snk"}[first["ref_kind"]]
        ax = axes[1, j]
        ax.set_facecolor("0.85")
        im = ax.imshow(np.ma.masked_invalid(grid), cmap="viridis", extent=(0, w, h, 0), interpolation="nearest",
                       vmin=0, vmax=max(1.0, math.hypot(h - 1, w - 1)))
        for (r, c), text in labels.items():
            ax.text(c + 0.5, r + 0.5, text, ha="center", va="center", fontsize=6,
                    color="white" if not math.isnan(grid[r, c]) else "black")
        ax.tick_params(labelsize=6)
        ax.set_title(f"distance (patches) to the nearest reference\n(over all patch references: mean "
                     f"{s['mean_patch_distance']:.2f})", fontsize=6.5)
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.03).ax.tick_params(labelsize=6)
    fig.suptitle("\n".join(textwrap.fill(line.removeprefix("# "), 150) for line in head[:2]), fontsize=6.5)
    fig.text(0.5, 0.005, "T: query patch (a coded visual token), arrows: its references that are patches of this image, "
             "nearest thickest; +n txt / img: references in the text / another image; outlined: patches stored as "
             "references (FP8 pool). Bottom: R reference, S sink, txt / img / snk: nearest reference not a patch.",
             ha="center", va="bottom", fontsize=5.5, wrap=True)
    fig.tight_layout(rect=(0, 0.03, 1, 0.95))
    _save(fig, out)
    return summary
