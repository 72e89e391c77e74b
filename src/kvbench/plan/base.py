"""The plan layer's vocabulary: runs, tables, and the protocol every plan implements.

- :class:`Run`: one ``kvbench eval`` run, model x dataset x method spec -> its directory
  ``results/runs/<profile>/<model>/<dataset>/[<group>/]<slug>``. Runs are grouped by the plan that asks for them
  (:data:`GROUPS`).
- :class:`Table`: one table target ``results/<name>.csv``: title, caption, the writer that builds it and the plan
  that says what it reads. Each paper's report module holds its entries; :data:`kvbench.report.tables.TABLES` joins
  them for the workflow (one ``table`` rule) and for ``kvbench report <name>``.
- :class:`Plan`: what one config section asks Snakemake to build: its runs (and, per run, what it reads, its
  threads and record limit) and its tables (what each reads, the JSON its writer gets). ``workflow/rules/common.smk``
  loops over the config's plans (:func:`kvbench.plan.build_plans`) and asks them; the writers rebuild the same plan
  from the JSON spec, so paths cannot drift apart.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

#: Run groups: the config section that asks for a run -> its sub-directory under the run's dataset.
GROUPS = {"eval": "", "conduit": "conduit", "residualkv": "residualkv",
          # ResidualKV Table II's VLM runs (kvbench.report.residualkv.table_ii): their own record limit, same directory name
          "residualkv_mm": "residualkv",
          # CONDUIT's Table 1 block on ResidualKV-compressed image caches (kvbench.report.beyond.conduit_rkv_cache)
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
        plan: the :attr:`Plan.name` of the plan that says what the table reads (default: ``section``).
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
    plan: str = ""
    contrasts: Callable[[Any, Any], list] | None = None
    contrast_text: str = ""

    @property
    def plan_name(self) -> str:
        """The plan that says what this table reads (:attr:`plan`, else the section's)."""
        return self.plan or self.section

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


class Plan:
    """What one config section asks Snakemake to build; the protocol ``workflow/rules/common.smk`` loops over.

    A plan is built from the validated config while the DAG is built (:meth:`from_config`, whose errors name the
    config key) and answers two questions with no per-table branch left to the workflow:

    - its runs (:meth:`runs`, each a :class:`Run` of the one ``eval`` rule) and, per run, what it reads besides the
      model and the split and the ``--method-params`` it passes (:meth:`resources`), its threads, record limit and
      scheduler minutes;
    - its tables (the :class:`Table` entries whose :attr:`Table.plan_name` is this plan's :attr:`name`): whether the
      config builds each (:meth:`builds`), what each reads (:meth:`table_inputs`) and the JSON spec its writer gets
      (:meth:`table_spec`).

    The defaults describe a plan with no runs and no tables.
    """

    #: The aggregate target (``snakemake conduit``) that builds this plan's tables and report figures; None: none.
    aggregate: str | None = None

    #: Figure targets of this plan (``conduit/fig3``) whose plotted numbers ``results/<target>.csv`` are compared with the
    #: paper's published figures (``compare.smk``), beside its tables.
    compare_figures: tuple[str, ...] = ()

    #: The plan's name: what :attr:`Table.plan` names and :func:`kvbench.plan.build_plans` keys it by.
    name: ClassVar[str] = ""

    @classmethod
    def absent(cls, table: Table, config: dict) -> str:
        """Why ``table`` cannot be built from ``config``, which lacks this plan (raised when it is asked for)."""
        return (f"this config has no `{table.section}:` section, so it has no {table.paper} target {table.path} "
                "(config/config.yaml shows one)")

    def runs(self) -> list[Run]:
        """Every run this plan's configured targets read, once each."""
        return []

    def resources(self, run: Run) -> tuple[dict[str, str], dict]:
        """``(inputs, method params)`` of ``run``: files it reads besides the model and split (by name), and the
        ``--method-params`` of ``kvbench eval``."""
        return {}, {}

    def threads(self, run: Run) -> int:
        """Intra-op threads of ``run``."""
        return 1

    def limit(self, run: Run) -> int | None:
        """Records ``run`` evaluates (None: every record of the split)."""
        return None

    def runtime(self, run: Run, zoo: bool) -> int:
        """Scheduler minutes of ``run``: an hour on the zoo, else six."""
        return 60 if zoo else 360

    def vlm_codec_models(self) -> list[str]:
        """Backbones this plan needs a VLM ResidualKV codec for (rule ``rkv_mm_codec``); none by default."""
        return []

    def builds(self, table: Table) -> bool:
        """Whether this config builds ``table`` (one of this plan's, :attr:`Table.plan_name`) in its aggregates; a
        table asked for by name is built whenever its plan exists."""
        return False

    def report_figures(self) -> list[list[str]]:
        """The figures this plan's rules can build for ``snakemake --report``, each with the report-marked files its
        job also writes (the figure, the CSV of its numbers)."""
        return []

    def table_inputs(self, table: Table) -> list[str]:
        """Files the ``table`` rule reads for ``table``.

        Raises:
            ValueError: the config cannot build it, naming the key to set.
        """
        raise ValueError(f"{table.name} is not a table of plan {self.name!r}")

    def table_spec(self, table: Table) -> str:
        """The JSON ``kvbench report <table> --spec`` reads."""
        raise ValueError(f"{table.name} is not a table of plan {self.name!r}")
