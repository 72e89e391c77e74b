"""ResidualKV Table II (multimodal): compression presses on VLMs, from the config's ``residualkv.tableII`` mapping.

Runs are ``kvbench eval`` jobs of a press spec on a VLM x an image task (:mod:`kvbench.eval.compress`, images through
:mod:`kvbench.compress.generate_vlm`), in ``results/runs/<profile>/<model>/<task>/residualkv/<slug>/`` (run group
``residualkv_mm``: its own record limit ``tableII.n_test``). The table (``results/residualkv/tableII.csv``) has one row
per backbone x method: the score per task (mean per-record score x 100), ``avg`` (unweighted mean over tasks, the
paper's average), ``KR_packed %`` / ``KR_resident %`` (bytes the cache holds at the end of each request over the full
FP16 cache, from the audit rows, as Table III: :func:`kvbench.report.residualkv.run_summary`), ``CR %`` (keys attention
read / keys visible after the context chunk) and ``kept %`` (share of the prompt's tokens whose K/V the cache still
holds). A cell is computed or empty with its reason in ``notes``.

Config (``residualkv.tableII``)::

    models: [tiny-qwen2.5-vl]          # VLM backbones (``models:`` entries of kind vlm)
    tasks: [docpages, digitgrid]       # VLM datasets (``datasets:``)
    n_test: 100                        # records per task (null: all)
    protocol: shared_context           # added to every row's spec unless it spells its own
    codec: {config: {d_c: 32, ...}, train: {steps: 300, lr: 0.001}, data_files: [...]}   # ResidualKV rows' codec
    rows: [{label: Full cache, method: fullkv}, {label: SnapKV, method: "snapkv:keep=0.1"}, ...]
                                       # a row's optional `models` restricts it to some backbones

A ResidualKV row reads one codec per backbone, trained by ``kvbench codec-train --data vlm`` on the backbone's own
image records (the smoke tasks' train splits, or ``codec.data_files``), visual tokens included
(:mod:`kvbench.compress.residualkv.vlm_data`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from kvbench.report import paired
from kvbench.plan.base import Run, Table, load_spec
from kvbench.utils.io import write_csv
from kvbench.report.residualkv import _mean, _read_run, bootstrap_settings, paired_rows, run_summary, with_paired
from kvbench.plan.residualkv import PROTOCOL_NOTES, Row, press_spec
from kvbench.eval.registry import with_params

#: The run group of Table II's runs (:data:`kvbench.plan.base.GROUPS`).
GROUP = "residualkv_mm"
#: The config key (under ``residualkv``) and the target key.
KEY = "tableII"
#: The paper's Table II budget (§V-B: every method at CR 10%; ResidualKV KR 8% on LLaVA-OV-7B, 10% on Qwen3-VL-8B).
PAPER_CR = 0.10


@dataclass
class MMPlan:
    """Table II's runs and rows (module docstring).

    Args:
        section: the config's ``residualkv.tableII`` mapping.
        profile: the config's profile (path component).
        zoo: per backbone, whether it is a zoo model (the header says so).

    Raises:
        ValueError: a missing key, an invalid row spec, a duplicate label, two specs sharing a run directory, or a
            press that takes a trained codec (ResidualKV) while ``residualkv.tableII.codec`` is not configured (rule
            ``rkv_mm_codec`` trains one per backbone from it); naming ``residualkv.tableII`` and the row.
    """

    section: dict
    profile: str
    zoo: dict

    def __post_init__(self) -> None:
        missing = [k for k in ("models", "tasks", "rows") if not self.section.get(k)]
        if missing:
            raise ValueError(f"config residualkv.tableII misses key(s) {missing} (config/config.yaml shows one)")
        self.models: list[str] = list(self.section["models"])
        self.tasks: list[str] = list(self.section["tasks"])
        self.rows = [Row(r["label"], self._spec(r)) for r in self.section["rows"]]
        #: per row, the backbones it runs on (its ``models``, default all): e.g. ResidualKV with each backbone's
        #: Table I full-attention layers
        self.row_models = [list(r.get("models") or self.models) for r in self.section["rows"]]
        for r, ms in zip(self.section["rows"], self.row_models):
            bad = sorted(set(ms) - set(self.models))
            if bad:
                raise ValueError(f"config residualkv.tableII.rows, row {r['label']!r}: models {bad} are not in "
                                 f"tableII.models {self.models}")
        for m in self.models:
            labels = [row.label for row in self.rows_of(m)]
            dup = sorted({x for x in labels if labels.count(x) > 1})
            if dup:
                raise ValueError(f"config residualkv.tableII.rows: label(s) {dup} given twice for {m!r}")
        slugs: dict[str, str] = {}
        for row in self.rows:
            slug = press_spec(row.spec).slug
            if slugs.setdefault(slug, row.spec) != row.spec:
                raise ValueError(f"config residualkv.tableII.rows: {slugs[slug]!r} and {row.spec!r} share run directory {slug!r}")

    @classmethod
    def from_spec(cls, spec: str | dict) -> "MMPlan":
        """The plan of the workflow's JSON ``spec`` (``{profile, tableII: section, zoo: {model: bool}}``)."""
        spec = load_spec(spec, KEY)
        return cls(spec[KEY], spec["profile"], spec.get("zoo", {}))

    def _spec(self, row: dict) -> str:
        where = f"config residualkv.tableII.rows, row {row.get('label')!r}"
        try:
            parsed = press_spec(row["method"])
            if "protocol" not in parsed.params:
                parsed = press_spec(with_params(row["method"], protocol=self.protocol))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        if self.takes_codec(parsed.canonical) and not self.section.get("codec"):
            raise ValueError(f"{where}: {parsed.name!r} needs a codec trained on each backbone's language model: "
                             "configure residualkv.tableII.codec (config/config.yaml shows one)")
        parsed.build()  # the press's own checks, at DAG time
        return parsed.canonical

    def rows_of(self, model: str) -> list[Row]:
        """The rows that run on backbone ``model``, in config order."""
        return [row for row, ms in zip(self.rows, self.row_models) if model in ms]

    def check_layers(self, n_layers: dict[str, int]) -> None:
        """Every row's press fits its backbone's depth (``n_layers``: backbone -> decoder layers, where known), by the
        press's own :meth:`check_layers` (full layers, filter layers, a pruning layer), as Tables III-VIII's plan does.

        Raises:
            ValueError: a press naming a layer outside the backbone, naming the row."""
        for model, n in n_layers.items():
            for row in self.rows_of(model):
                try:
                    press_spec(row.spec).build().check_layers(n)
                except ValueError as e:
                    raise ValueError(f"config residualkv.tableII.rows, row {row.label!r} on {model!r}: {e}") from None

    @staticmethod
    def takes_codec(spec: str) -> bool:
        """Whether the press of ``spec`` reads a trained codec (ResidualKV)."""
        return "codec_dir" in press_spec(spec).cls.__dataclass_fields__

    def codec_recipe(self, model: str, model_dir: str, seed: int, data_files: list[str]) -> dict:
        """Everything that determines ``model``'s codec weights (``tableII.codec``: CodecConfig fields and training
        keys; the seed, backbone directory and training files): its directory is ``codecs/<profile>/<model>/mm-<hash>``."""
        codec = self.section["codec"]
        # where it trains is not what it learns (the LM codecs' PLACEMENT_KEYS); the dtype is. Threads stay outside
        # the hash as the LM codecs' do (a directory that names a thread count Snakemake may cap would mislead)
        train = {k: v for k, v in codec.get("train", {}).items() if k not in ("device", "checkpointing", "threads")}
        return {"codec": codec.get("config", {}), "train": train, "seed": seed,
                "model": str(model_dir), "data_files": sorted(data_files)}

    @property
    def protocol(self) -> str:
        """The section's ``protocol`` (default ``shared_context``: with one-token answers under ``one_pass`` the answer
        comes from the exact prompt chunk, which a press that compresses after the prefill cannot change; presses that
        prune inside the prefill, FastV, PACT and DivPrune, spell ``protocol=one_pass`` in their rows, as the originals
        run)."""
        return self.section.get("protocol", "shared_context")

    @property
    def n_test(self) -> int | None:
        return self.section.get("n_test")

    def run(self, model: str, task: str, spec: str) -> Run:
        parsed = press_spec(spec)
        return Run(model, task, parsed.canonical, parsed.slug, GROUP)

    def runs(self) -> list[Run]:
        """Every run of the table: backbone x task x row."""
        return [self.run(m, t, r.spec) for m in self.models for r in self.rows_of(m) for t in self.tasks]

    def header(self) -> list[str]:
        """The CSV's ``#`` lines: what ran (tiny zoo or local checkpoints), protocol, budgets and the paper's CR caveat."""
        zoo = [m for m in self.models if self.zoo.get(m, True)]
        what = (f"model(s) {', '.join(self.models)} (tiny zoo VLM trained here, not the paper's models: LLaVA-OV-7B, "
                f"Qwen3-VL-8B); tasks {', '.join(self.tasks)} (smoke image tasks in place of MMB, MME, MMMU, POPE, SQA, "
                "Video-MME, MVBench); not the paper's numbers" if zoo else
                f"model(s) {', '.join(self.models)} (local checkpoints); tasks {', '.join(self.tasks)} (local benchmark "
                "files); computed by this pipeline, not copied from the paper")
        protocols = sorted({press_spec(r.spec).params["protocol"] for r in self.rows})
        budgets = "; ".join(dict.fromkeys(f"{r.label}: {_budget(r.spec)}" for r in self.rows))
        return [
            f"# kvbench ResidualKV Table II (multimodal: methods x image tasks, KR/CR), profile {self.profile!r}: {what}",
            f"# protocol: {'; '.join(PROTOCOL_NOTES[p] for p in protocols)}; the context chunk holds the system "
            "prompt and every image, the question chunk the question (kvbench.compress.generate_vlm)",
            f"# budget ran: {budgets}. The paper ran every Table II method at CR {100 * PAPER_CR:.0f}% (ResidualKV KR 8% on "
            "LLaVA-OV-7B, 10% on Qwen3-VL-8B)",
            "# CR caveat (notes §3.3, §4.1): by the paper's own formula CR = beta + (1 - beta) r, ResidualKV with Table I's 7 "
            "full-attention layers of Qwen3-VL-8B's 36 has CR >= 7/36 = 19.4%, so its Table II label 'CR 10%' is "
            "inconsistent with that layer configuration; CR % here is measured (keys read / keys visible), not a label",
            "# scores: mean per-record score x 100; KR_packed %: packed bytes / full FP16 cache (measured); KR_resident %: "
            "bytes of every tensor held; kept %: share of the tokens whose K/V the cache holds at the end",
        ]


def _budget(spec: str) -> str:
    """A row's budget parameters (its spec's parameters but the protocol), or 'full cache'."""
    params = {k: v for k, v in press_spec(spec).params.items() if k != "protocol"}
    return ", ".join(f"{k}={v}" for k, v in params.items()) or "full cache"


def cr_bounds(plan: MMPlan, root: str | Path = ".") -> str:
    """The header line of the CR lower bound of each row that keeps whole layers (``full_layers``): by the paper's
    formula CR = beta + (1 - beta) r (notes §3.3), CR >= beta = full-attention layers / layers, here computed from
    the row's spec and the layer count of its runs' audit (bytes by layer), beside the paper's 7/36 on Qwen3-VL-8B
    (Table I). Empty when no row keeps full layers."""
    bounds = []
    for model in plan.models:
        for row in plan.rows_of(model):
            full = press_spec(row.spec).params.get("full_layers")
            if not full:
                continue
            layers = {len(r["plan"]["bytes"]) for t in plan.tasks
                      for r in _read_run(Path(root) / plan.run(model, t, row.spec).path(plan.profile))
                      if r.get("status") == "ok" and isinstance(r.get("plan"), dict) and r["plan"].get("bytes")}
            if len(layers) != 1:
                bounds.append(f"{model} {row.label}: no layer count in its runs' audit" if not layers else
                              f"{model} {row.label}: runs disagree on the layer count {sorted(layers)}")
                continue
            (n,) = layers
            bounds.append(f"{model} {row.label}: {len(full)}/{n} = {100 * len(full) / n:.1f}%")
    if not bounds:
        return ""
    return ("# CR lower bound of the rows that keep full-attention layers, beta = full layers / layers (from the row's "
            f"spec and its runs' layer count): {'; '.join(bounds)} (the paper's ResidualKV on Qwen3-VL-8B: 7/36 = 19.4%)")


def _kept(run_dir: Path) -> float:
    plans = [r["plan"] for r in _read_run(run_dir) if r.get("status") == "ok" and isinstance(r.get("plan"), dict)]
    return _mean([p.get("kept") for p in plans])


def score_table(plan: MMPlan, root: str | Path = ".") -> pd.DataFrame:
    """Backbone x method rows, task columns (module docstring)."""
    pct = lambda x: None if math.isnan(x) else round(100 * x, 1)  # noqa: E731
    out = []
    for model in plan.models:
        for row in plan.rows_of(model):
            cells, notes = {"model": model, "method": row.label, "spec": row.spec}, []
            dirs = [Path(root) / plan.run(model, t, row.spec).path(plan.profile) for t in plan.tasks]
            runs = [run_summary(d) for d in dirs]
            for task, s in zip(plan.tasks, runs):
                cells[task] = round(s["score"], 2)
                if s["errors"]:
                    notes.append(f"{task}: {s['errors']}/{s['n']} samples failed (scored 0)")
            cells["avg"] = round(_mean([cells[t] for t in plan.tasks]), 2)
            cells["KR_packed %"] = pct(_mean([s["kr_packed"] for s in runs]))
            resident = [s["kr_resident"] for s in runs]
            cells["KR_resident %"] = None if any(math.isnan(x) for x in resident) else pct(_mean(resident))
            cells["CR %"] = pct(_mean([s["cr"] for s in runs]))
            cells["kept %"] = pct(_mean([_kept(d) for d in dirs]))
            for col in ("KR_packed %", "CR %", "kept %"):
                if cells[col] is None:
                    notes.append(f"{col}: no audit row in the runs")
            cells["notes"] = "; ".join(notes)
            out.append(cells)
    return pd.DataFrame(out)


def paired_by_model(plan: MMPlan, df: pd.DataFrame, boot: dict, root: str | Path = ".") -> tuple[pd.DataFrame, list[str]]:
    """``df`` with every pair of each backbone's rows below it (:func:`kvbench.report.residualkv.paired_rows`, a
    ``model`` column naming the backbone) and the header lines saying how."""
    pairs = []
    for model in plan.models:
        rows = [(r.label, r.spec, [Path(root) / plan.run(model, t, r.spec).path(plan.profile) for t in plan.tasks])
                for r in plan.rows_of(model)]
        pairs += [{"model": model, **p} for p in paired_rows(rows, plan.tasks, boot)]
    out = with_paired(df, pairs)
    # `model` leads, as in the score rows
    out = out[["model"] + [c for c in out.columns if c != "model"]]
    return out, paired.difference_header(pairs, "every pair of one backbone's rows, a above b in table order",
                                         **boot)


def _write(key: str, spec: str | dict, out: str | Path, root: str | Path = ".") -> pd.DataFrame:
    spec = load_spec(spec, KEY)
    plan = MMPlan.from_spec(spec)
    df, lines = paired_by_model(plan, score_table(plan, root), bootstrap_settings(spec), root)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    bound = cr_bounds(plan, root)
    write_csv(df, plan.header() + ([bound] if bound else []) + lines, str(out))
    return df


TABLES: dict[str, Table] = {t.name: t for t in (
    Table("residualkv/tableII", "ResidualKV", "residualkv", "Table II (multimodal: methods x image tasks, KR/CR)",
          "**ResidualKV Table II** (paper §V-B, multimodal): compression presses on VLMs against the full KV cache, per "
          "image task; visual-token pruning baselines (FastV, PACT, DivPrune) and cache compression read the same "
          "prompt (the context chunk with every image, then the question reading the compressed cache). KR is measured "
          "from the bytes the cache holds (packed: the paper's accounting; resident: every tensor held); CR from the "
          "keys attention read. On the smoke profile the model is the tiny zoo VLM and the tasks are smoke image tasks "
          "in place of the paper's seven benchmarks: these are not the paper's numbers. The paper's 'CR 10%' for "
          "ResidualKV on Qwen3-VL-8B is below its own lower bound beta = 7/36 (header).", _write),
)}
