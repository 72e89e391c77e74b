"""ResidualKV Table V's plan: long generation on ``residualkv.long_generation``'s backbone and tasks.

Table V runs the ``residualkv.tableV`` rows on another backbone than the other tables (a model that generates long
answers) with that backbone's own codec, so it has its own :class:`~kvbench.plan.residualkv.RKVPlan` built from the
section as :func:`generation_section` reads it; :mod:`kvbench.report.residualkv.table_v` writes the table.
"""
from __future__ import annotations

import json

from kvbench.compress.generate import Sampling
from kvbench.plan.residualkv import RKVPlan

#: Keys of ``residualkv.long_generation`` that replace the section's own for Table V's plan.
GENERATION_KEYS = ("model", "tasks", "n_test", "threads", "protocol", "codec", "sampling")
#: Keys the generation plan takes from the main section unless ``long_generation`` sets them.
INHERITED_KEYS = ("n_test", "threads", "protocol", "codec", "bootstrap")
#: Sampling keys (:class:`kvbench.compress.generate.Sampling`), passed to every run as method parameters.
SAMPLING_KEYS = ("temperature", "top_p", "top_k")


def generation_section(section: dict) -> dict:
    """The ``residualkv`` section as Table V's plan reads it (module docstring): ``long_generation``'s keys over the
    section's :data:`INHERITED_KEYS`, its ``train`` keys over the section's ``train``, the rows of ``tableV``. The
    section's ``codec.import`` (an authors' compressor for ``residualkv.model``) is inherited only by that same model:
    another ``long_generation.model`` without its own ``codec`` trains one with the section's codec settings.

    Raises:
        ValueError: no ``long_generation`` mapping, or it lacks ``model``/``tasks``, or sets an unknown key, or no
            ``tableV`` rows.
    """
    gen = section.get("long_generation")
    if not isinstance(gen, dict):
        raise ValueError("residualkv.tableV runs on residualkv.long_generation's backbone and task: set "
                         "long_generation: {model, tasks, ...} (config/config.yaml shows one)")
    missing = [k for k in ("model", "tasks") if k not in gen]
    unknown = sorted(set(gen) - set(GENERATION_KEYS) - {"train"})
    if missing or unknown:
        raise ValueError(f"residualkv.long_generation: missing {missing} / unknown {unknown} key(s); keys are "
                         f"{sorted({*GENERATION_KEYS, 'train'})}")
    if not section.get("tableV"):
        raise ValueError("residualkv.tableV has no rows")
    out = {k: section[k] for k in INHERITED_KEYS if k in section}
    if "codec" not in gen and gen["model"] != section.get("model") and "import" in out.get("codec", {}):
        # an imported compressor is residualkv.model's weights, of its shape: another backbone inherits the codec
        # settings and trains its own (the table header names the codec it used)
        out["codec"] = {k: v for k, v in out["codec"].items() if k != "import"}
    out.update({k: gen[k] for k in GENERATION_KEYS if k in gen})
    out["train"] = {**section.get("train", {}), **gen.get("train", {})}
    out["tableIII"] = []   # the plan's required key; Table V's rows are its only targets
    out["tableV"] = section["tableV"]
    sampling(out)   # checked while the DAG is built
    return out


def sampling(section: dict) -> dict:
    """The runs' sampling method parameters from the generation section's ``sampling`` (``{}``: greedy).

    Raises:
        ValueError: a key outside :data:`SAMPLING_KEYS`, or values :class:`~kvbench.compress.generate.Sampling` refuses.
    """
    s = section.get("sampling") or {}
    bad = sorted(set(s) - set(SAMPLING_KEYS))
    if bad:
        raise ValueError(f"residualkv.long_generation.sampling: unknown key(s) {bad}; expected {list(SAMPLING_KEYS)}")
    Sampling(**s)
    return dict(s)


def generation_plan(section: dict, profile: str, shape: tuple[int, int] | None = None, zoo: bool = True, *,
                    seed: int | None = None, model_dir: str | None = None) -> RKVPlan:
    """Table V's :class:`RKVPlan` from the config's ``residualkv`` section (:func:`generation_section`); the other
    arguments are :class:`RKVPlan`'s, for the ``long_generation`` backbone."""
    return RKVPlan(generation_section(section), profile, shape, zoo, seed=seed, model_dir=model_dir)


class GenerationPlan(RKVPlan):
    """Table V's plan: an :class:`RKVPlan` of :func:`generation_section` on ``residualkv.long_generation``'s backbone,
    whose only target is ``tableV`` (its runs take the section's ``sampling``)."""

    name = "residualkv_generation"

    @classmethod
    def absent(cls, table, config: dict) -> str:
        if "residualkv" not in config:
            return super().absent(table, config)
        return (f"config residualkv.{table.key} is not set, so {table.key} has no rows (config/config.yaml shows one)")

    @classmethod
    def from_config(cls, ws, plans: dict) -> "GenerationPlan | None":
        """Table V's plan (None without ``residualkv.tableV`` rows), checked while the DAG is built.

        Raises:
            ValueError: ``long_generation.model`` is not an LM of ``models``, a task is not a text dataset of
                ``datasets``, or the section is invalid (:func:`generation_section`), naming the key.
        """
        if not ws.config.get("residualkv", {}).get("tableV"):
            return None
        gen = ws.config["residualkv"].get("long_generation") or {}
        model = gen.get("model")
        if model not in ws.models or ws.models[model]["kind"] != "lm":
            raise ValueError(f"config residualkv.long_generation.model: {model!r} must be an `lm` model defined under "
                             "`models` (Table V's backbone)")
        for task in gen.get("tasks", []):
            if task not in ws.datasets:
                raise ValueError(f"config residualkv.long_generation.tasks: {task!r} is not defined under `datasets`")
            if ws.datasets[task].get("kind") == "vlm":   # the backbone is an LM (checked above)
                raise ValueError(f"config residualkv.long_generation.tasks: {task!r} is a `vlm` dataset; Table V's LM "
                                 f"backbone {model!r} needs `text` tasks")
        try:
            plan = cls(generation_section(RKVPlan._workflow_section(ws)), ws.profile, ws.model_shape(model),
                       ws.is_zoo(model), seed=ws.seed, model_dir=ws.model_dir(model))
        except ValueError as e:
            raise ValueError(f"config residualkv.tableV: {e}") from e
        plan.ws = ws
        return plan

    def builds(self, table) -> bool:
        return True

    def report_figures(self) -> list[list[str]]:
        return []   # the figures are the main plan's

    def report_spec(self) -> str:
        """:meth:`RKVPlan.report_spec` plus the evaluated splits (records per problem)."""
        spec = json.loads(super().report_spec())
        spec["splits"] = {t: self.ws.split_file(t) for t in self.tasks}
        return json.dumps(spec, sort_keys=True)
