# Helpers of ResidualKV Fig. 3 (workflow/rules/rkv_observations.smk; Table I's inputs are its plan's, kvbench.plan.residualkv):
# functions only, as Snakemake's lint wants them apart from rules.

PUBLISHED_RKV = WS.published("residualkv")
#: `residualkv.fig3` defaults besides model and tasks (workflow/schemas/config.schema.yaml describes them).
RKV_FIG3_DEFAULTS = {"records_per_task": 2, "max_tokens": 4096, "context_tokens": None, "device": "cpu",
                     "dtype": "float32"}


def _rkv_fig3():
    """The `residualkv.fig3` settings with the defaults filled in (model: residualkv.model, tasks: residualkv.tasks),
    checked while the DAG is built: a text model and text datasets of the config."""
    if "residualkv" not in config:
        return None
    s = dict(config["residualkv"].get("fig3") or {})
    s.setdefault("model", config["residualkv"]["model"])
    s.setdefault("tasks", list(config["residualkv"]["tasks"]))
    for key, default in RKV_FIG3_DEFAULTS.items():
        s.setdefault(key, default)
    if s["model"] not in MODELS:
        raise ValueError(f"config residualkv.fig3.model: {s['model']!r} is not defined under `models`")
    for task in s["tasks"]:
        if task not in DATASETS or DATASETS[task].get("kind", "text") != "text":
            raise ValueError(f"config residualkv.fig3.tasks: {task!r} must be a text dataset under `datasets` "
                             "(its records' contexts are analysed)")
    return s


RKV_FIG3 = _rkv_fig3()


def rkv_fig3_schedule_flags():
    """`--k --n-sink --stride --alpha --grid --block` of the main codec (imported: from its checkpoint; trained: the
    config's `residualkv.codec` over CodecConfig's defaults), so Fig. 3's residual is the one the codec codes."""
    import dataclasses

    from kvbench.compress.residualkv.codec import CodecConfig

    plan = rkv_plan()
    if plan.codecs.source("main"):
        cfg = dataclasses.asdict(plan.codecs.config("main", plan.shape))
    else:
        cfg = {f.name: f.default for f in dataclasses.fields(CodecConfig) if f.default is not dataclasses.MISSING}
        cfg.update(plan.codecs.overrides("main"))
    return ["--k", int(cfg["k"]), "--n-sink", int(cfg["n_sink"]), "--stride", int(cfg["stride"]),
            "--alpha", float(cfg["alpha"]), "--grid", cfg["grid"], "--block", int(cfg["window"])]


def rkv_fig3_args():
    """The analysis flags, shell-quoted: the main codec's schedule (:func:`rkv_fig3_schedule_flags`), then
    `residualkv.fig3`'s records per task, token caps, device and dtype."""
    import shlex

    s = RKV_FIG3
    args = rkv_fig3_schedule_flags() + ["--records-per-task", int(s["records_per_task"]), "--max-tokens",
                                        int(s["max_tokens"])]
    if s.get("context_tokens"):
        args += ["--context-tokens", int(s["context_tokens"])]
    args += ["--device", s["device"], "--dtype", s["dtype"]] + (["--zoo"] if is_zoo(s["model"]) else [])
    return " ".join(shlex.quote(str(a)) for a in args)
