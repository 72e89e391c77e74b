"""The plan of the table beyond both papers: CONDUIT's Table 1 block over ResidualKV-compressed image caches.

CONDUIT's Limitations name the storage of the cached visual K/V as its remaining cost. Here each image's cache is
stored in ResidualKV's form (:mod:`kvbench.beyond.compressed_store`: references + codes, restored when a request
reuses the image) and Table 1's rows at one budget ``r`` run again on the restored caches;
:mod:`kvbench.report.beyond.conduit_rkv_cache` writes the table.

Config (``beyond.conduit_rkv_cache``)::

    model: tiny-qwen2.5-vl          # a conduit.models backbone; its VLM codec is rule rkv_mm_codec's
    r: 0.1                          # the Table 1 block (conduit.budgets)
    storage: {full_layers: [0, 1], full_kv_bits: 4, bits: 4, n_sink: 0}   # CacheCodec fields

Runs: the compressed-cache runs are ``kvbench eval`` refresh runs of Table 1's specs whose method parameters select
the compressed store (run group ``conduit_rkv``: ``results/runs/<profile>/<model>/<dataset>/conduit-rkv/<slug>``,
records ``conduit.n_test`` as Table 1's); the raw side is Table 1's runs, and full prefill (which reads no cache) is
one run on both sides.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from kvbench.eval.registry import slug
from kvbench.plan.base import Plan, Run, Table
from kvbench.plan.conduit import Column, ConduitPlan, Row
from kvbench.beyond.compressed_store import CacheCodec
from kvbench.utils.recipe import recipe_hash

#: The run group (:data:`kvbench.plan.base.GROUPS`) and the config key under ``beyond``.
GROUP = "conduit_rkv"
KEY = "conduit_rkv_cache"


@dataclass
class CompressedCachePlan(Plan):
    """Which runs and caches the compressed-image-cache table reads (module docstring).

    Args:
        section: the config's ``beyond.conduit_rkv_cache`` mapping.
        conduit: the config's :class:`~kvbench.report.conduit.accuracy.ConduitPlan` (Table 1's rows, columns and runs).

    Raises:
        ValueError: ``model`` not in ``conduit.models``, ``r`` not one of ``conduit.budgets``, or a bad ``storage``
            (:class:`~kvbench.beyond.compressed_store.CacheCodec`'s checks), naming the key.
    """

    section: dict
    conduit: ConduitPlan

    name = "conduit_rkv_cache"

    def __post_init__(self) -> None:
        self.ws = self.mm = None  # the workflow's Workspace and Table II's plan (from_config: the codec)
        where = f"config beyond.{KEY}"
        self.model = self.section["model"]
        if self.model not in self.conduit.models:
            raise ValueError(f"{where}.model: {self.model!r} is not a CONDUIT backbone (conduit.models "
                             f"{self.conduit.models}); the raw side is its Table 1 runs")
        self.r = self.section["r"]
        if self.r not in self.conduit.cfg["budgets"]:
            raise ValueError(f"{where}.r: {self.r!r} is not a Table 1 block (conduit.budgets "
                             f"{self.conduit.cfg['budgets']})")
        try:
            self.storage_spec("<checked at DAG time>")
        except (ValueError, TypeError) as e:
            raise ValueError(f"{where}.storage: {e}") from None

    def vlm_codec_models(self) -> list[str]:
        """Its backbone: the compressed caches are stored with that VLM's codec (Table II's recipe)."""
        return [self.model]

    @property
    def storage(self) -> dict:
        return dict(self.section.get("storage") or {})

    def storage_spec(self, codec_dir: str) -> CacheCodec:
        """The :class:`CacheCodec` of ``storage`` with the codec at ``codec_dir`` (no codec is read here)."""
        return CacheCodec.from_spec({"codec_dir": codec_dir, **self.storage})

    def rows(self) -> list[Row]:
        """Table 1's rows of the ``r`` block (cache reuse and full prefill included), in Table 1's order."""
        return [row for row in self.conduit.rows("table1") if row.r == self.r]

    @property
    def columns(self) -> list[Column]:
        return self.conduit.columns("table1")

    @property
    def datasets(self) -> list[str]:
        return list(dict.fromkeys(c.dataset for c in self.columns))

    def raw_run(self, dataset: str, spec: str) -> Run:
        """Table 1's run of ``spec``."""
        return self.conduit.run(self.model, dataset, spec)

    def compressed_run(self, dataset: str, spec: str) -> Run:
        """The run of ``spec`` on the compressed caches; full prefill (no cache read) is Table 1's own run."""
        if spec == self.conduit.reference:
            return self.raw_run(dataset, spec)
        return Run(self.model, dataset, spec, slug(spec), GROUP)

    def new_runs(self) -> list[Run]:
        """The runs this table adds (every row but full prefill, per dataset of Table 1's columns)."""
        return [self.compressed_run(d, row.spec) for d in self.datasets for row in self.rows()
                if row.spec != self.conduit.reference]

    def raw_runs(self) -> list[Run]:
        return [self.raw_run(d, spec) for d in self.datasets for spec in dict.fromkeys(r.spec for r in self.rows())]

    def cache_dir(self, dataset: str, codec_dir: str) -> str:
        """``cache/conduit_rkv/<profile>/<model>/<dataset>/<tag>``: the compressed caches of one codec and storage
        setting (tag = hash of both), so a changed setting gets a new directory instead of a mismatch."""
        tag = recipe_hash({"codec_dir": codec_dir, "storage": self.storage_spec(codec_dir).to_spec()})
        return f"cache/conduit_rkv/{self.conduit.profile}/{self.model}/{dataset}/s-{tag}"

    # --- the workflow's protocol (kvbench.plan.base.Plan) -------------------------------------------
    @classmethod
    def from_config(cls, ws, plans: dict) -> "CompressedCachePlan | None":
        """The plan of ``beyond.conduit_rkv_cache`` (None without it), checked while the DAG is built: CONDUIT's plan
        and Table II's codec exist, and ``storage.full_layers`` fits a zoo backbone's depth.

        Raises:
            ValueError: naming the missing section or the bad key.
        """
        section = (ws.config.get("beyond") or {}).get(KEY)
        if not section:
            return None
        if plans.get("conduit") is None:
            raise ValueError(f"config beyond.{KEY} reruns CONDUIT's Table 1 rows on compressed image caches, but the "
                             "config has no `conduit:` section")
        if not ws.config.get("residualkv"):
            raise ValueError(f"config beyond.{KEY} stores the image caches with a VLM codec trained from "
                             "residualkv.tableII.codec, but the config has no `residualkv:` section")
        mm = plans.get("residualkv_mm")
        if mm is None or not mm.section.get("codec"):
            raise ValueError(f"config beyond.{KEY} stores the image caches with the backbone's VLM codec, trained by "
                             "rule rkv_mm_codec from residualkv.tableII.codec: configure that mapping "
                             "(config/config.yaml shows one)")
        plan = cls(section, plans["conduit"])
        # a zoo model's depth is known now (a checkpoint's is checked by the cache job): fail before anything trains
        shape = ws.model_shape(plan.model) if ws.is_zoo(plan.model) else None
        bad = [l for l in plan.storage.get("full_layers", []) if shape and not 0 <= int(l) < shape[0]]
        if bad:
            raise ValueError(f"config beyond.{KEY}.storage.full_layers: {bad} outside {plan.model}'s {shape[0]} layers "
                             f"(0..{shape[0] - 1})")
        plan.ws, plan.mm = ws, mm
        return plan

    @classmethod
    def absent(cls, table: Table, config: dict) -> str:
        if "beyond" not in config:
            return super().absent(table, config)
        return (f"this config has no `beyond.{KEY}:` mapping, so it has no compressed-image-cache table "
                "(config/config.yaml shows one)")

    @property
    def codec_dir(self) -> str:
        """The codec the compressed caches are coded with: Table II's (rule ``rkv_mm_codec``) for the backbone."""
        return f"{self.mm.codec_dir(self.model)}/codec"

    def runs(self) -> list[Run]:
        return self.new_runs()

    def resources(self, run: Run) -> tuple[dict[str, str], dict]:
        """A compressed-cache run reads the compressed caches of its dataset (rule ``conduit_rkv_cache``)."""
        root = self.cache_dir(run.dataset, self.codec_dir)
        return {"cache": f"{root}/index.json"}, {"cache_dir": root, "build_missing": False,
                                                  "compressed": self.storage_spec(self.codec_dir).to_spec()}

    def threads(self, run: Run) -> int:
        return self.conduit.threads(run)

    def limit(self, run: Run) -> int | None:
        return self.conduit.limit(run)

    def builds(self, table: Table) -> bool:
        return True

    def table_inputs(self, table: Table) -> list[str]:
        """The compressed runs, Table 1's raw runs of the block, the compressed caches' indexes (bytes) and the splits
        (K buckets)."""
        runs = [f"{r.path(self.conduit.profile)}/predictions.jsonl" for r in self.new_runs() + self.raw_runs()]
        return (runs + [f"{self.cache_dir(d, self.codec_dir)}/index.json" for d in self.datasets]
                + [self.ws.split_file(d) for d in self.datasets])

    def table_spec(self, table: Table) -> str:
        """The JSON :mod:`kvbench.report.beyond.conduit_rkv_cache`'s writer reads."""
        config = self.ws.config
        return json.dumps({"profile": self.conduit.profile, "conduit": config["conduit"], "beyond": config["beyond"],
                           "splits": {d: self.ws.split_file(d) for d in self.datasets},
                           "zoo_models": self.ws.zoo_models, "codec_dir": self.codec_dir,
                           "indexes": {d: f"{self.cache_dir(d, self.codec_dir)}/index.json" for d in self.datasets}},
                          sort_keys=True)
