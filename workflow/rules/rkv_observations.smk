# ResidualKV Table I and Fig. 3 (issue #17): what the backbones and their K/V are, rather than runs over them.
#
#   table (tables.smk)  results/residualkv/tableI.csv: each model's config.json (2 d_k, layers), the main codec's
#                       codec.json (d_c, d_ff), Table III's ResidualKV row (full layers), the published values beside
#                       them (kvbench.report.rkv_table1); its inputs and spec are the functions below
#   rkv_observations    results/residualkv/fig3.csv: `kvbench analyze rkv-observations` over the first contexts of the
#                       `residualkv.fig3` tasks' test splits (kvbench.compress.residualkv.observations)
#   rkv_fig3            figures/residualkv/fig3.pdf + results/residualkv/fig3_summary.csv (the two headline numbers
#                       beside the paper's) from that CSV
# A config without a `residualkv:` section has none of them.

PUBLISHED_RKV = os.path.join(workflow.basedir, "config", "published", "residualkv.yaml")
#: ResidualKV tables built from checkpoints and codecs, not from runs (no config list of rows).
RKV_MODEL_TABLES = ("tableI",)
#: `residualkv.fig3` defaults besides model and tasks (workflow/schemas/config.schema.yaml describes them).
RKV_FIG3_DEFAULTS = {"records_per_task": 2, "max_tokens": 4096, "context_tokens": None, "device": "cpu",
                     "dtype": "float32"}


def rkv_table_i_models():
    """Table I's rows: `residualkv.model`, then every other model with a Table I entry (`models.<m>.codec`)."""
    main = config["residualkv"]["model"]
    return [main] + [m for m, spec in MODELS.items() if spec.get("codec") and m != main]


def rkv_table_i_inputs(wc):
    """Each row's config.json, the main codec's codec.json (the table depends on the codec job), the published file."""
    codec = f"{rkv_plan().codec_dir('main')}/codec/codec.json"
    return [os.path.join(model_dir(m), "config.json") for m in rkv_table_i_models()] + [codec, PUBLISHED_RKV]


def rkv_table_i_spec():
    """`kvbench report residualkv/tableI --spec`: the ResidualKV report spec plus the rows' models and the published file."""
    spec = json.loads(rkv_report_spec())
    spec["models"] = [{"name": m, "dir": model_dir(m), "codec": MODELS[m].get("codec")} for m in rkv_table_i_models()]
    spec["published"] = PUBLISHED_RKV
    return json.dumps(spec, sort_keys=True)


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
    if plan.codec_import("main"):
        cfg = dataclasses.asdict(plan.codec_config("main", plan.shape))
    else:
        cfg = {f.name: f.default for f in dataclasses.fields(CodecConfig) if f.default is not dataclasses.MISSING}
        cfg.update(plan.codec_overrides("main"))
    return (f"--k {int(cfg['k'])} --n-sink {int(cfg['n_sink'])} --stride {int(cfg['stride'])} "
            f"--alpha {float(cfg['alpha'])!r} --grid {cfg['grid']} --block {int(cfg['window'])}")


def rkv_fig3_args():
    """The analysis flags of `residualkv.fig3` (records per task, token caps, device, dtype)."""
    s = RKV_FIG3
    args = f"--records-per-task {int(s['records_per_task'])} --max-tokens {int(s['max_tokens'])}"
    if s.get("context_tokens"):
        args += f" --context-tokens {int(s['context_tokens'])}"
    return args + f" --device {s['device']} --dtype {s['dtype']}" + (" --zoo" if is_zoo(s["model"]) else "")


rule rkv_observations:
    """Fig. 3's data: pre-RoPE K||V of every layer over the first contexts of each task's test split, their max cosine
    to earlier tokens and its distance, and raw vs reference residuals (the main codec's schedule)."""
    input:
        model=lambda wc: os.path.join(model_dir(RKV_FIG3["model"]), "config.json"),
        splits=lambda wc: [split_file(t) for t in RKV_FIG3["tasks"]],
    output:
        report(
            "results/residualkv/fig3.csv",
            caption="../report/rkv_fig3_data.rst",
            category="ResidualKV",
            subcategory="Figure data",
        ),
    params:
        model=lambda wc: model_dir(RKV_FIG3["model"]),
        name=lambda wc: RKV_FIG3["model"],
        profile=PROFILE,
        splits=lambda wc: [f"{t}={split_file(t)}" for t in RKV_FIG3["tasks"]],
        schedule=lambda wc: rkv_fig3_schedule_flags(),
        args=lambda wc: rkv_fig3_args(),
    log:
        "logs/residualkv/fig3_observations.log",
    benchmark:
        "benchmarks/residualkv/fig3_observations.tsv"
    threads: 1
    resources:
        mem_mb=lambda wc: MODELS[RKV_FIG3["model"]].get("mem_mb", 4000 if is_zoo(RKV_FIG3["model"]) else 64000),
        runtime=lambda wc: 30 if is_zoo(RKV_FIG3["model"]) else 120,
        gpu=lambda wc: 1 if str(RKV_FIG3["device"]).startswith("cuda") else 0,
    conda:
        "../../envs/kvbench.yaml"
    shell:
        "kvbench analyze rkv-observations --model {params.model:q} --model-name {params.name:q} --split {params.splits:q}"
        " --out {output:q} --profile {params.profile:q} {params.schedule} {params.args} --threads {threads} > {log:q} 2>&1"


rule rkv_fig3:
    input:
        data="results/residualkv/fig3.csv",
        published=PUBLISHED_RKV,
    output:
        pdf=report(
            "figures/residualkv/fig3.pdf",
            caption="../report/rkv_fig3.rst",
            category="ResidualKV",
            subcategory="Figures",
        ),
        summary=report(
            "results/residualkv/fig3_summary.csv",
            caption="../report/rkv_fig3_data.rst",
            category="ResidualKV",
            subcategory="Figure data",
        ),
    log:
        "logs/residualkv/fig3.log",
    benchmark:
        "benchmarks/residualkv/fig3.tsv"
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
        gpu=0,
    conda:
        "../../envs/kvbench.yaml"
    shell:
        "kvbench report residualkv-fig3 --raw {input.data:q} --published {input.published:q} --out {output.pdf:q}"
        " --data-out {output.summary:q} > {log:q} 2>&1"
