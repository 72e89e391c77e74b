"""ResidualKV Table I (§V-A, Table I): per backbone, 2·d_k, the codec's d_c and d_ff, and the full-attention layers,
as this pipeline has them, beside the paper's.

One row per model of the profile that ResidualKV runs on: ``residualkv.model`` and every model with a Table I entry
(``models.<m>.codec``: config/paper.yaml). Columns:

- ``n_layers``, ``2d_k`` (= 2 x ``num_key_value_heads`` x ``head_dim``): from the checkpoint's ``config.json`` (a VLM's
  ``text_config``; :func:`kvbench.compress.residualkv.codec.config_kv_shape`);
- ``d_c``, ``d_ff``: from the codec the runs read, ``codec/codec.json`` of the main codec (trained or imported;
  :meth:`kvbench.plan.codecs.CodecPlan.dir`), for ``residualkv.model`` only: no codec is built for the
  others (empty, with the reason);
- ``full_attention_layers``: for ``residualkv.model`` those of the spec of Table III's ResidualKV row (the row
  labelled ``ResidualKV``, else the first with ``full_layers``); for the others their ``models.<m>.codec`` entry;
- ``d_c/2d_k``, ``d_ff/2d_k``: the ratios (the smoke codec copies Table I's ratios, config/config.yaml);
- ``published <col>`` and ``<col> mismatch`` (``yes``/``no``, empty when either side is missing): the paper's values
  (config/published/residualkv.yaml, entries of ``tableI``, matched by backbone: its ``backbones`` mapping; the
  full-attention layers from the ``2d_k`` entry's text); on the smoke profile the zoo LM is none of the paper's
  backbones, so these are empty and ``notes`` lists the paper's ratios per backbone instead.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd

from kvbench.plan.base import Table, load_spec
from kvbench.utils.io import write_csv
from kvbench.plan.residualkv import RKVPlan, press_spec

#: Table I's columns compared with the paper's, in order.
COMPARED = ("2d_k", "d_c", "d_ff", "full_attention_layers", "d_c/2d_k", "d_ff/2d_k")


def _layers(text: str) -> str:
    """``"0, 1, 4"`` -> ``"0+1+4"`` (the press specs' list syntax), from published text."""
    m = re.search(r"full-attention layers ([0-9, ]+)", text)
    return "+".join(x.strip() for x in m.group(1).split(",") if x.strip()) if m else ""


def published_rows(published: str | Path) -> dict[str, dict]:
    """``{paper backbone: {2d_k, d_c, d_ff, full_attention_layers, d_c/2d_k, d_ff/2d_k, models, source}}`` from the
    ``tableI`` entries of the published-figures file.

    Raises:
        kvbench.report.published.PublishedError: the file breaks its schema.
    """
    from kvbench.report.published import load_published

    pub = load_published(published)
    out: dict[str, dict] = {}
    for e in pub.for_table("tableI"):
        row = out.setdefault(e.backbone, {"models": pub.models_of(e.backbone), "source": pub.source(e)})
        row[e.metric] = int(e.value)
        if e.metric == "2d_k" and e.text:
            row["full_attention_layers"] = _layers(e.text)
    for row in out.values():
        for col in ("d_c", "d_ff"):
            if row.get(col) and row.get("2d_k"):
                row[f"{col}/2d_k"] = round(row[col] / row["2d_k"], 4)
    return out


def main_row_layers(plan: RKVPlan) -> tuple[str, str]:
    """``(layers "a+b+...", row label)`` of Table III's ResidualKV row: the row labelled ``ResidualKV``, else the
    first row whose press has ``full_layers``; ``("", "")`` when none has."""
    rows = sorted(plan.rows("tableIII"), key=lambda r: r.label != "ResidualKV")
    for row in rows:
        layers = getattr(press_spec(row.spec).build(), "full_layers", ())
        if layers:
            return "+".join(map(str, layers)), row.label
    return "", ""


def _kv_fields(path: Path) -> dict:
    from kvbench.compress.residualkv.codec import config_kv_shape

    if not path.is_file():
        raise FileNotFoundError(f"Table I reads {path}, which is missing (the model's config.json)")
    cfg = json.loads(path.read_text())
    n_layers, d_kv = config_kv_shape(cfg, str(path))
    return {"n_layers": n_layers, "2d_k": d_kv}


def table_i(spec: dict, root: str | Path = ".") -> pd.DataFrame:
    """Table I (module docstring) from the workflow's ``spec`` (:func:`kvbench.plan.residualkv.RKVPlan.from_spec`'s
    JSON plus ``models``: ``[{name, dir, codec}]``, ``published``: the published-figures file).

    Raises:
        FileNotFoundError: a model's config.json or the main codec's codec.json is missing.
        ValueError: a config.json lacks its KV fields.
    """
    plan = RKVPlan.from_spec(spec)
    pub = published_rows(spec["published"]) if spec.get("published") else {}
    by_model = {m: (backbone, row) for backbone, row in pub.items() for m in row["models"]}
    paper_ratios = "; ".join(f"{b} {r.get('d_c/2d_k')}/{r.get('d_ff/2d_k')}" for b, r in pub.items())
    out = []
    for m in spec["models"]:
        name, notes = m["name"], []
        cells: dict = {"model": name, **_kv_fields(Path(root) / m["dir"] / "config.json")}
        if name == plan.model:
            codec_json = Path(root) / plan.codecs.dir("main") / "codec" / "codec.json"
            if not codec_json.is_file():
                raise FileNotFoundError(f"Table I reads the main codec's {codec_json}, which is missing (build it: "
                                        f"snakemake {codec_json})")
            codec = json.loads(codec_json.read_text())
            cells.update({"d_c": codec["d_c"], "d_ff": codec["d_ff"]})
            if (codec["n_layers"], codec["d_kv"]) != (cells["n_layers"], cells["2d_k"]):
                notes.append(f"the codec was built for {codec['n_layers']} layers x 2d_k {codec['d_kv']}, not this "
                             "checkpoint's")
            layers, label = main_row_layers(plan)
            cells["full_attention_layers"] = layers
            cells["source"] = (f"config.json; {plan.codecs.origin('main', root)}; full layers: Table III row {label!r}"
                               if label else f"config.json; {plan.codecs.origin('main', root)}; no Table III row has "
                               "full_layers")
        else:
            cells.update({"d_c": None, "d_ff": None})
            notes.append(f"d_c, d_ff: no codec is built for this model (this profile's ResidualKV runs on {plan.model})")
            entry = m.get("codec") or {}
            cells["full_attention_layers"] = "+".join(map(str, entry.get("full_attention_layers", [])))
            cells["source"] = f"config.json; full layers: config models.{name}.codec"
        for col in ("d_c", "d_ff"):
            cells[f"{col}/2d_k"] = round(cells[col] / cells["2d_k"], 4) if cells[col] else None
        backbone, published = by_model.get(name, ("", {}))
        cells["paper backbone"] = backbone
        for col in COMPARED:
            theirs = published.get(col)
            cells[f"published {col}"] = theirs
            ours = cells[col]
            cells[f"{col} mismatch"] = ("" if theirs in (None, "") or ours in (None, "")
                                        else "yes" if str(ours) != str(theirs) else "no")
        if not backbone:
            notes.append(f"{name} is not a backbone of the paper's Table I ("
                         + ("the tiny zoo LM" if plan.zoo else "no published entry names it")
                         + f"): no published values; the paper's d_c/2d_k / d_ff/2d_k: {paper_ratios}")
        bad = [c for c in COMPARED if cells[f"{c} mismatch"] == "yes"]
        if bad:
            notes.append(f"differs from the paper in {', '.join(bad)}")
        cells["published source"] = published.get("source", "")
        cells["notes"] = "; ".join(notes)
        out.append(cells)
    df = pd.DataFrame(out)
    for col in ("n_layers", "2d_k", "d_c", "d_ff", "published 2d_k", "published d_c", "published d_ff"):
        df[col] = df[col].astype("Int64")  # widths stay integers beside an empty cell
    return df


def write_table(key: str, spec: str | dict, out: str | Path, root: str | Path = ".") -> pd.DataFrame:
    """Compute and write Table I under its ``#`` header (:meth:`RKVPlan.header`)."""
    spec = load_spec(spec, "residualkv")
    df = table_i(spec, root)
    plan = RKVPlan.from_spec(spec)
    header = plan.header(TABLES["residualkv/tableI"].title) + [
        "# 2d_k, n_layers: the checkpoint's config.json; d_c, d_ff: the main codec's codec.json (the codec the runs "
        "read); full_attention_layers: Table III's ResidualKV row (other models: their config entry); published: "
        "config/published/residualkv.yaml (tableI); '<col> mismatch' yes/no, empty where a side is missing"]
    write_csv(df, header, str(out))
    return df


TABLES: dict[str, Table] = {t.name: t for t in (
    Table("residualkv/tableI", "ResidualKV", "residualkv", "Table I (codec configuration per backbone)",
          "**ResidualKV Table I** (paper §V-A): per backbone, 2·d_k (K and V of all KV heads, from the checkpoint's "
          "config.json), the residual code width d_c and the encoder's inner width d_ff (from the codec the runs "
          "read: trained here or imported), and the full-attention layers (from Table III's ResidualKV row), with "
          "the paper's values beside them and a mismatch flag per column. On the smoke profile the backbone is the "
          "tiny zoo LM, which is none of the paper's (not the paper's numbers): the published columns are empty and "
          "the notes give the paper's ratios d_c/2d_k and d_ff/2d_k, which the zoo codec copies.", write_table),
)}
