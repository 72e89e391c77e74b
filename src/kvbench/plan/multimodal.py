"""ResidualKV Table II's plan (multimodal): compression presses on VLMs, from the config's ``residualkv.tableII`` mapping.

Runs are ``kvbench eval`` jobs of a press spec on a VLM x an image task (:mod:`kvbench.eval.compress`, images through
:mod:`kvbench.compress.generate_vlm`), in ``results/runs/<profile>/<model>/<task>/residualkv/<slug>/`` (run group
``residualkv_mm``: its own record limit ``tableII.n_test``); :mod:`kvbench.report.residualkv.table_ii` writes the table.

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

import json
import os
import shlex
from dataclasses import dataclass

from kvbench.data.smoke import TASKS
from kvbench.eval.registry import with_params
from kvbench.plan.base import Plan, Run, Table, load_spec
from kvbench.utils.recipe import recipe_hash
from kvbench.plan.residualkv import Row, press_spec, protocol_note

#: The run group of Table II's runs (:data:`kvbench.plan.base.GROUPS`).
GROUP = "residualkv_mm"
#: The config key (under ``residualkv``) and the target key.
KEY = "tableII"
#: The paper's Table II budget (§V-B: every method at CR 10%; ResidualKV KR 8% on LLaVA-OV-7B, 10% on Qwen3-VL-8B).
PAPER_CR = 0.10


@dataclass
class MMPlan(Plan):
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

    name = "residualkv_mm"

    def __post_init__(self) -> None:
        self.ws = None  # the workflow's Workspace (from_config)
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
        budgets = "; ".join(dict.fromkeys(f"{r.label}: {_budget(r.spec)}" for r in self.rows))
        return [
            f"# kvbench ResidualKV Table II (multimodal: methods x image tasks, KR/CR), profile {self.profile!r}: {what}",
            f"# protocol: {protocol_note([r.spec for r in self.rows])}; the context chunk holds the system "
            "prompt and every image, the question chunk the question (kvbench.compress.generate_vlm)",
            f"# budget ran: {budgets}. The paper ran every Table II method at CR {100 * PAPER_CR:.0f}% (ResidualKV KR 8% on "
            "LLaVA-OV-7B, 10% on Qwen3-VL-8B)",
            "# CR caveat (paper §V-A; §V-B, Table II): by the paper's own formula CR = beta + (1 - beta) r, ResidualKV with Table I's 7 "
            "full-attention layers of Qwen3-VL-8B's 36 has CR >= 7/36 = 19.4%, so its Table II label 'CR 10%' is "
            "inconsistent with that layer configuration; CR % here is measured (keys read / keys visible), not a label",
            "# scores: mean per-record score x 100; KR_packed %: packed bytes / full FP16 cache (measured); KR_resident %: "
            "bytes of every tensor held; kept %: share of the tokens whose K/V the cache holds at the end",
        ]

    # --- the workflow's protocol (kvbench.plan.base.Plan) -------------------------------------------
    @classmethod
    def from_config(cls, ws, plans: dict) -> "MMPlan | None":
        """Table II's plan (None without ``residualkv.tableII``), checked while the DAG is built: VLM backbones, VLM
        tasks, every row's press fitting each zoo backbone's depth (a checkpoint's is checked when its job loads it).

        Raises:
            ValueError: naming ``residualkv.tableII``'s key and the bad value.
        """
        section = ws.config.get("residualkv", {}).get("tableII")
        if not section:
            return None
        for m in section["models"]:
            if m not in ws.models or ws.models[m].get("kind") != "vlm":
                raise ValueError(f"config residualkv.tableII.models: {m!r} must be a `vlm` model defined under `models`")
        for t in section["tasks"]:
            # a dataset's kind: its `kind:` or, for a smoke dataset without one, its generator's
            if t not in ws.datasets or (ws.datasets[t].get("kind") or (TASKS[t].kind if t in TASKS else None)) != "vlm":
                raise ValueError(f"config residualkv.tableII.tasks: {t!r} must be a `vlm` dataset defined under "
                                 "`datasets`")
        plan = cls(section, ws.profile, {m: ws.is_zoo(m) for m in section["models"]})
        plan.check_layers({m: ws.model_shape(m)[0] for m in plan.models if ws.is_zoo(m)})
        plan.ws = ws
        return plan

    @classmethod
    def absent(cls, table: Table, config: dict) -> str:
        if "residualkv" not in config:
            return super().absent(table, config)
        return ("this config has no `residualkv.tableII:` mapping, so it has no ResidualKV Table II "
                "(config/config.yaml shows one)")

    def resources(self, run: Run) -> tuple[dict[str, str], dict]:
        """A ResidualKV row reads its backbone's VLM codec (rule ``rkv_mm_codec``)."""
        if not self.takes_codec(run.spec):
            return {}, {}
        codec = f"{self.codec_dir(run.model)}/codec"
        return {"codec": f"{codec}/codec.json"}, {"codec_dir": codec}

    def threads(self, run: Run) -> int:
        return self.section.get("threads", 1)

    def limit(self, run: Run) -> int | None:
        return self.n_test

    def builds(self, table: Table) -> bool:
        return True

    def table_inputs(self, table: Table) -> list[str]:
        return [f"{run.path(self.profile)}/predictions.jsonl" for run in self.runs()]

    def table_spec(self, table: Table) -> str:
        """The JSON Table II's writer reads (:meth:`from_spec`)."""
        return json.dumps({"profile": self.profile, "tableII": self.section, "zoo": self.zoo,
                           "bootstrap": self.ws.config["residualkv"]["bootstrap"]}, sort_keys=True)

    # --- each backbone's VLM codec (rule rkv_mm_codec) ----------------------------------------------------
    def vlm_codec_models(self) -> list[str]:
        """Table II's backbones: each has its own VLM codec."""
        return list(self.models)

    def codec_files(self) -> list[str]:
        """Training records of the codecs: ``codec.data_files`` (local JSONL, under ``paths.root``), else the tasks'
        smoke train splits.

        Raises:
            ValueError: no ``data_files`` and a task without a train split here.
        """
        files = self.section["codec"].get("data_files") or []
        if files:
            return [self.ws.local_path(f) for f in files]
        not_smoke = [t for t in self.tasks if "smoke" not in self.ws.datasets[t]]
        if not_smoke:
            raise ValueError(f"config residualkv.tableII.codec: tasks {not_smoke} have no train split here; give the "
                             "codec's training records as codec.data_files (local JSONL of VLM records)")
        return [os.path.join(os.path.dirname(self.ws.split_file(t)), "train.jsonl") for t in self.tasks]

    def codec_dir(self, model: str) -> str:
        """``codecs/<profile>/<model>/mm-<recipe hash>``: backbone ``model``'s codec (:meth:`codec_recipe`)."""
        recipe = self.codec_recipe(model, self.ws.model_dir(model), self.ws.seed, self.codec_files())
        return f"codecs/{self.profile}/{model}/mm-{recipe_hash(recipe)}"

    def codec_flags(self) -> str:
        """``--device/--dtype/--checkpointing`` of the codec training (``tableII.codec.train``) where not defaults,
        each shell-quoted (config text never reaches the shell unquoted)."""
        t = self.section["codec"]["train"]
        flags = []
        if t.get("device", "cpu") != "cpu":
            flags += ["--device", t["device"]]
        if t.get("dtype", "float32") != "float32":
            flags += ["--dtype", t["dtype"]]
        if t.get("checkpointing"):
            flags.append("--checkpointing")
        return " ".join(shlex.quote(f) for f in flags)

    def codec_gpus(self) -> int:
        """GPUs the codec training asks the scheduler for (0 on the CPU)."""
        return 1 if str(self.section["codec"]["train"].get("device", "cpu")).startswith("cuda") else 0


def _budget(spec: str) -> str:
    """A row's budget parameters (its spec's parameters but the protocol), or 'full cache'."""
    params = {k: v for k, v in press_spec(spec).params.items() if k != "protocol"}
    return ", ".join(f"{k}={v}" for k, v in params.items()) or "full cache"

