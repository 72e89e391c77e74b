# Helpers of ResidualKV Fig. 13 (workflow/rules/rkv_fig13.smk): functions only, as Snakemake's lint wants them apart
# from rules. Table II's plan (MM), its codec directory (MM.codec_dir) and rows come from common.smk.

def _rkv_fig13():
    """The `residualkv.fig13` settings, checked while the DAG is built, with the defaults filled in (model: the first of
    `residualkv.tableII.models`, task: the first of its tasks; the other keys' defaults are the schema's, filled in by
    its validation) and `method`: Table II's ResidualKV row of that model (the press whose storage is drawn). None
    without `residualkv.fig13`."""
    from kvbench.compress.residualkv.visual_case import StoreSchedule, check_layers
    from kvbench.compress.residualkv.observations import ReferenceSchedule
    from kvbench.data.smoke import TASKS
    from kvbench.plan.residualkv import known_model_shape, press_spec

    s = dict(config.get("residualkv", {}).get("fig13") or {})
    if not s:
        return None
    if MM is None:
        raise ValueError("config residualkv.fig13 draws the references of Table II's ResidualKV row with its codec: "
                         "configure residualkv.tableII (with its codec), config/config.yaml shows one")
    s.setdefault("model", MM.models[0])
    s.setdefault("task", MM.tasks[0])
    if s["model"] not in MM.models:
        raise ValueError(f"config residualkv.fig13.model: {s['model']!r} is not one of residualkv.tableII.models "
                         f"{MM.models} (its codec is trained there)")
    task = s["task"]
    if task not in DATASETS or (DATASETS[task].get("kind") or (TASKS[task].kind if task in TASKS else None)) != "vlm":
        raise ValueError(f"config residualkv.fig13.task: {task!r} must be a `vlm` dataset defined under `datasets`")
    # a smoke split's length is its config's n_test: an index past it is refused here, not when the job reads the split
    # (a local benchmark file's length, and every record's image count, are known only then)
    n_test = (DATASETS[task].get("smoke") or {}).get("n_test")
    if n_test is not None and not 0 <= int(s["record"]) < int(n_test):
        raise ValueError(f"config residualkv.fig13.record: {s['record']} is outside {task}'s test split of {n_test} "
                         f"records (datasets.{task}.smoke.n_test); expected 0..{int(n_test) - 1}")
    rows = [r for r in MM.rows_of(s["model"]) if MM.takes_codec(r.spec)]
    if not rows:
        raise ValueError(f"config residualkv.fig13: residualkv.tableII has no ResidualKV row for {s['model']!r}, so no "
                         "stored references to draw")
    s["method"] = rows[0].spec
    press = press_spec(s["method"]).build()
    # the schedule itself is the codec's (read when the job runs); the layers are checked against the row's full layers
    # and a zoo model's depth (a checkpoint's when the job loads it: a dry run's stand-in config.json may differ)
    shape = known_model_shape(s["model"], MODELS[s["model"]]) if is_zoo(s["model"]) else None
    try:
        check_layers(s["layers"], shape[0] if shape else 10**9, StoreSchedule(ReferenceSchedule(), True,
                                                                               tuple(press.full_layers)))
    except ValueError as e:
        raise ValueError(f"config residualkv.fig13.layers: {e}") from None
    return s


RKV_FIG13 = _rkv_fig13()


def rkv_fig13():
    """The checked `residualkv.fig13` settings (:func:`_rkv_fig13`).

    Raises:
        ValueError: the config has no `residualkv.fig13`."""
    if RKV_FIG13 is None:
        raise ValueError("config residualkv.fig13 is not set, so ResidualKV's Fig. 13 (visual case) is not a target "
                         "(config/config.yaml shows one)")
    return RKV_FIG13


def rkv_fig13_inputs(wc):
    """The model's config.json, the task's test split (the record and its image) and the ResidualKV row's codec."""
    s = rkv_fig13()
    return {"model": os.path.join(model_dir(s["model"]), "config.json"), "split": split_file(s["task"]),
            "codec": f"{MM.codec_dir(s['model'])}/codec/codec.json"}


def rkv_fig13_args():
    """`--record --image --layers --device --dtype [--zoo]` of `kvbench analyze rkv-visual-case`, shell-quoted."""
    import shlex

    s = rkv_fig13()
    args = ["--record", int(s["record"]), "--image", int(s["image"]), "--layers", *[int(i) for i in s["layers"]],
            "--device", s["device"], "--dtype", s["dtype"]] + (["--zoo"] if is_zoo(s["model"]) else [])
    return " ".join(shlex.quote(str(a)) for a in args)
