"""The plan layer: what Snakemake builds and the reports read, named once.

- :class:`Run`: one ``kvbench eval`` run, model x dataset x method spec -> its directory
  ``results/runs/<profile>/<model>/<dataset>/[<group>/]<slug>``. Runs are grouped by the config section
  that asks for them (``eval`` matrix: no group; ``conduit``; ``residualkv``).
- :class:`Table`: one table target ``results/<name>.csv``: title, caption, the rows it compares and the
  writer that builds it. Each paper's module holds its entries (:data:`kvbench.report.conduit.TABLES`,
  :data:`kvbench.report.residualkv.TABLES`, :data:`kvbench.bench.table3.TABLES`); :data:`TABLES` joins them
  for the workflow (one ``table`` rule) and for ``kvbench report <name>``. Adding a table is one entry plus
  its config keys.

The workflow's helpers (``workflow/rules/common.smk``) and the writers ask the same objects, so paths
cannot drift apart.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: Run groups: the config section that asks for a run -> its sub-directory under the run's dataset.
GROUPS = {"eval": "", "conduit": "conduit", "residualkv": "residualkv",
          # ResidualKV Table II's VLM runs (kvbench.report.rkv_multimodal): their own record limit, same directory name
          "residualkv_mm": "residualkv",
          # CONDUIT's Table 1 block on ResidualKV-compressed image caches (kvbench.report.conduit_rkv)
          "conduit_rkv": "conduit-rkv"}


@dataclass(frozen=True)
class Run:
    """One evaluation run.

    Attributes:
        model: config model name.
        dataset: config dataset name.
        spec: canonical method spec (:mod:`kvbench.utils.spec`).
        slug: the spec's run-directory name (:attr:`kvbench.utils.spec.MethodSpec.slug`).
        group: ``eval``, ``conduit`` or ``residualkv`` (:data:`GROUPS`).
    """

    model: str
    dataset: str
    spec: str
    slug: str
    group: str = "eval"

    @property
    def name(self) -> str:
        """The run's name under its dataset: ``<slug>`` or ``<group>/<slug>`` (the workflow's ``{run}``)."""
        sub = GROUPS[self.group]
        return f"{sub}/{self.slug}" if sub else self.slug

    def path(self, profile: str) -> str:
        """``results/runs/<profile>/<model>/<dataset>/<name>``."""
        return f"results/runs/{profile}/{self.model}/{self.dataset}/{self.name}"


@dataclass(frozen=True)
class Table:
    """One table target, ``results/<name>.csv``.

    Attributes:
        name: ``<paper dir>/<key>``, e.g. ``conduit/table1``, ``residualkv/tableIII``.
        paper: ``CONDUIT`` or ``ResidualKV`` (the report's category).
        section: the config section the table is built from (``conduit``, ``residualkv``, ``conduit_latency``);
            a config without it has no such target.
        title: the table's title, first header line of the CSV.
        caption: reStructuredText shown with the table in ``snakemake --report``.
        write: ``write(spec, out, root)`` builds the table from the workflow's JSON ``spec`` (the paper's config
            section and paths) and writes ``out`` atomically; returns the DataFrame.
        rows: ``rows(plan)`` -> the methods a CONDUIT table compares (ResidualKV tables take theirs from the config
            list of their own name, :meth:`kvbench.plan.residualkv.RKVPlan.rows`), else None.
        columns: which column group a CONDUIT table averages over (``multi_image``, ``single_image``, ``all``).
        contrasts: ``contrasts(plan, scores)`` -> ``[(backbone, row a, row b)]`` whose paired difference a - b a
            CONDUIT table carries below its scores (Tables 1 and 5), else None.
        contrast_text: what the contrasts compare, for the CSV header.
    """

    name: str
    paper: str
    section: str
    title: str
    caption: str
    write: Callable[[str, dict, str, str], Any]
    rows: Callable[[Any], list] | None = None
    columns: str = ""
    contrasts: Callable[[Any, Any], list] | None = None
    contrast_text: str = ""

    @property
    def key(self) -> str:
        """The name without its paper directory (``table1``): the plan's target name."""
        return self.name.split("/", 1)[1]

    def build(self, spec: str | dict, out: str, root: str = ".") -> Any:
        """Build this table from the workflow's JSON ``spec`` into ``out`` (runs and splits under ``root``)."""
        return self.write(self.key, spec, out, root)

    @property
    def path(self) -> str:
        """``results/<name>.csv``."""
        return f"results/{self.name}.csv"


def load_spec(spec: str | dict, section: str) -> dict:
    """The workflow's JSON report spec (``{"profile", <section>: config section, ...}``) as a dict.

    Raises:
        ValueError: ``spec`` is not a JSON object, or it lacks ``profile`` or ``section``.
    """
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"the report spec (--spec, --{section}) must be JSON {{profile, {section}, ...}}, "
                             f"got {spec[:80]!r} ({e.msg})") from e
    if not isinstance(spec, dict) or not isinstance(spec.get(section), dict) or "profile" not in spec:
        raise ValueError(f"the report spec must be a JSON object with `profile` and a `{section}` mapping (the "
                         f"config section), got {str(spec)[:80]!r}")
    return spec
