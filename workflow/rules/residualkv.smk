# ResidualKV (issue #4): codec training, compression runs, tables and figures.
#
#   rkv_codec       one per codec variant: `kvbench codec-train` on the frozen zoo LM
#                   -> codecs/<profile>/<model>/<variant>-<recipe hash>/{codec/,curves.csv,summary.json} (state/ resumes;
#                   the hash covers what determines the weights, so a config change trains into a new directory)
#   rkv_codec_import  the main codec imported instead (`residualkv.codec.import`: the authors' compressor
#                   checkpoint): `kvbench codec-import` -> codecs/<profile>/<model>/main-import-<hash>/codec/
#                   {codec.json, codec.safetensors, provenance.json}; runs read it like a trained one
#   runs            `eval` jobs (eval.smk): one per task x press spec -> results/runs/<profile>/<model>/<task>/residualkv/<slug>/
#   tables          `table` jobs (tables.smk): results/residualkv/table{III,VI,VII,VIII}.csv
#   rkv_fig5, rkv_codec_figures (fig10, fig11, fig12)   figures/residualkv/fig<N>.pdf (+ results/residualkv/fig<N>.csv)
#   rkv_throughput  results/residualkv/fig8.csv (decode tokens/s vs context) -> rkv_fig8 figures/residualkv/fig8.pdf
#   rkv_codec_cost  results/residualkv/fig6.csv (codec cost) -> rkv_fig6 figures/residualkv/fig6.pdf
#   rkv_variant_throughput  results/residualkv/fig11_throughput.csv (Fig. 11's throughput panel)
# Which runs and codecs a target reads is decided by kvbench.plan.residualkv.RKVPlan, for the rules and
# the report alike. A config without a `residualkv:` section has no ResidualKV targets.


rule rkv_codec:
    """One codec; `{codec}` is `<variant>-<recipe hash>` of a configured variant (RKVPlan.codec_dir). A job whose
    `slice_s` ends first saves its state and fails (exit 3); rerunning resumes. `slice_s` is a resource, not a
    param, so changing it never reruns a finished codec."""
    input:
        model=lambda wc: os.path.join(model_dir(wc.model), "config.json"),
        corpus=lambda wc: [local_path(f) for f in codec_plan(wc).training(codec_variant(wc)).get("data_files", [])],
    output:
        codec="codecs/{profile}/{model}/{codec}/codec/codec.json",
        summary="codecs/{profile}/{model}/{codec}/summary.json",
    wildcard_constraints:
        codec=alternation(RKV_CODECS),
    params:
        model=lambda wc: model_dir(wc.model),
        out=lambda wc, output: os.path.dirname(output.summary),
        overrides=lambda wc: json.dumps(codec_plan(wc).overrides(codec_variant(wc)), sort_keys=True),
        train=lambda wc: codec_plan(wc).training(codec_variant(wc)),
        launch=lambda wc: codec_plan(wc).launcher(codec_variant(wc)),
        args=lambda wc: codec_plan(wc).train_flags(codec_variant(wc), local_path),  # device, dtype, corpus
        seed=SEED,
    log:
        "logs/residualkv/codec/{profile}/{model}/{codec}.log",
    benchmark:
        "benchmarks/residualkv/codec/{profile}/{model}/{codec}.tsv"
    # 1 by default: bit-identical weights run to run (residualkv.train.threads; 2 threads measured to differ)
    threads: config.get("residualkv", {}).get("train", {}).get("threads", 1)
    resources:
        mem_mb=model_resource("mem_mb", 8000, 64000),
        runtime=lambda wc: codec_plan(wc).runtime_min(codec_variant(wc)),  # minutes: slice + load/save, or estimate
        slice_s=lambda wc: codec_plan(wc).slice_s(codec_variant(wc)) or 0,  # seconds; 0: no slice
        gpu=lambda wc: codec_plan(wc).gpus(codec_variant(wc)),  # residualkv.train device/gpus
    conda:
        "../../envs/kvbench.yaml"
    shell:
        "{params.launch} codec-train --model {params.model:q} --out {params.out:q} --overrides {params.overrides:q}"
        " --objective {params.train[objective]:q} --steps {params.train[steps]:q} --seq-len {params.train[seq_len]:q}"
        " --slice-s {resources.slice_s:q} --lr {params.train[lr]:q} --data {params.train[data]:q} --seed {params.seed:q}"
        " --threads {threads} {params.args} > {log:q} 2>&1"


rule rkv_codec_import:
    """The main codec imported from the authors' compressor checkpoint named by `residualkv.codec.import` (or, for
    Table V's backbone, `residualkv.long_generation.codec.import`)
    (kvbench.compress.residualkv.deltakv_format): the same codec/codec.json output as rkv_codec, so runs and tables
    read it alike. The checkpoint was checked while the DAG was built (config.json, tensor names and shapes
    against the backbone); the job checks it again, copies the weights and records their sha256."""
    input:
        model=lambda wc: os.path.join(model_dir(wc.model), "config.json"),
        checkpoint=lambda wc: import_plan(wc).import_files(import_variant(wc)),
    output:
        codec="codecs/{profile}/{model}/{codec}/codec/codec.json",
        provenance="codecs/{profile}/{model}/{codec}/codec/provenance.json",
    wildcard_constraints:
        codec=alternation(RKV_IMPORTS),
    params:
        model=lambda wc: model_dir(wc.model),
        src=lambda wc: import_plan(wc).source(import_variant(wc)),
        out=lambda wc, output: os.path.dirname(output.codec),
        overrides=lambda wc: json.dumps(import_plan(wc).overrides(import_variant(wc)), sort_keys=True),
    log:
        "logs/residualkv/codec/{profile}/{model}/{codec}.log",
    benchmark:
        "benchmarks/residualkv/codec/{profile}/{model}/{codec}.tsv"
    threads: 1
    resources:
        mem_mb=model_resource("mem_mb", 4000, 32000),
        runtime=30,
        gpu=0,
    conda:
        "../../envs/kvbench.yaml"
    shell:
        "kvbench codec-import --from-deltakv {params.src:q} --out {params.out:q} --model {params.model:q}"
        " --overrides {params.overrides:q} > {log:q} 2>&1"


rule rkv_fig5:
    input:
        rkv_run_inputs("fig5"),
    output:
        pdf=report(
            "figures/residualkv/fig5.pdf",
            caption="../report/rkv_fig5.rst",
            category="ResidualKV",
            subcategory="Figures",
        ),
        csv=report(
            "results/residualkv/fig5.csv",
            caption="../report/rkv_fig5_data.rst",
            category="ResidualKV",
            subcategory="Figure data",
        ),
    params:
        spec=lambda wc: rkv_report_spec(),
    log:
        "logs/residualkv/fig5.log",
    benchmark:
        "benchmarks/residualkv/fig5.tsv"
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
        gpu=0,
    conda:
        "../../envs/kvbench.yaml"
    shell:
        "kvbench report residualkv-fig5 --residualkv {params.spec:q} --out {output.pdf:q} --data-out {output.csv:q} > {log:q} 2>&1"


rule rkv_codec_figures:
    input:
        summaries=lambda wc: [f"{rkv_plan().codecs.dir(v)}/summary.json" for v in FIGURE_VARIANTS[wc.fig]],
        throughput=lambda wc: ["results/residualkv/fig11_throughput.csv"] if wc.fig == "fig11" else [],
    output:
        pdf=report(
            "figures/residualkv/{fig}.pdf",
            caption="../report/rkv_codec_figure.rst",
            category="ResidualKV",
            subcategory="Figures",
        ),
        csv=report(
            "results/residualkv/{fig}.csv",
            caption="../report/rkv_codec_figure_data.rst",
            category="ResidualKV",
            subcategory="Figure data",
        ),
    wildcard_constraints:
        fig="fig10|fig11|fig12",
    params:
        spec=lambda wc: rkv_report_spec(),
        raw=lambda wc, input: ["--raw", *input.throughput] if input.throughput else [],
    log:
        "logs/residualkv/{fig}.log",
    benchmark:
        "benchmarks/residualkv/{fig}.tsv"
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
        gpu=0,
    conda:
        "../../envs/kvbench.yaml"
    shell:
        "kvbench report residualkv-{wildcards.fig:q} --residualkv {params.spec:q} --out {output.pdf:q}"
        " --data-out {output.csv:q} {params.raw:q} > {log:q} 2>&1"


rule rkv_variant_throughput:
    """Fig. 11's throughput panel: each variant codec's shape, scaled to the random-weight timing LM, timed."""
    input:
        codecs=lambda wc: [f"{rkv_plan().codecs.dir(v)}/codec/codec.json" for v in FIGURE_VARIANTS["fig11"]],
        tokenizer=f"{TOKENIZER_DIR}/tokenizer.json",
    output:
        report(
            "results/residualkv/fig11_throughput.csv",
            caption="../report/rkv_fig11_throughput.rst",
            category="ResidualKV",
            subcategory="Figure data",
        ),
    params:
        codecs=lambda wc, input: [f"{v}={os.path.dirname(c)}" for v, c in zip(FIGURE_VARIANTS["fig11"], input.codecs)],
        tokenizer=lambda wc, input: os.path.dirname(input.tokenizer),
        args=lambda wc: rkv_bench_args("fig11"),
        default=DEFAULT_VARIANT,
    log:
        "logs/residualkv/fig11_bench.log",
    benchmark:
        "benchmarks/residualkv/fig11_bench.tsv"
    threads: 2
    resources:
        mem_mb=8000,
        runtime=30,
        gpu=rkv_bench_gpus("fig11"),
    conda:
        "../../envs/kvbench.yaml"
    shell:
        "kvbench bench rkv-variants --out {output:q} --codecs {params.codecs:q} --default {params.default:q}"
        " --tokenizer {params.tokenizer:q} --threads {threads} {params.args} > {log:q} 2>&1"


localrules:
    residualkv,


rule residualkv:
    """Every ResidualKV target of the config (Tables I-VIII that it configures: II needs `residualkv.tableII`, V
    `residualkv.tableV`; Figures 3, 5, 6, 8, 10, 11, 12, and 13 with `residualkv.fig13`)."""
    input:
        lambda wc: rkv_plan() and [table_of(t).path for t in configured_tables() if t.startswith("residualkv/")]
        + [f"figures/residualkv/fig{n}.pdf" for n in (3, 5, 6, 8, 10, 11, 12)]
        + (["figures/residualkv/fig13.pdf"] if RKV_FIG13 else []),  # rkv_fig13.smk: only with `residualkv.fig13`


rule rkv_throughput:
    """Fig. 8's measurements: decode tokens/s (95% interval) and achieved bandwidth vs context on a random-weight
    timing LM, a fresh cache per (context, method), transformers' DynamicCache+SDPA as the full-attention
    reference (CPU here; scripts/gpu_fig8.sh on a lent GPU)."""
    input:
        tokenizer=f"{TOKENIZER_DIR}/tokenizer.json",
    output:
        report(
            "results/residualkv/fig8.csv",
            caption="../report/rkv_fig8_data.rst",
            category="ResidualKV",
            subcategory="Figure data",
        ),
    params:
        tokenizer=lambda wc, input: os.path.dirname(input.tokenizer),
        args=lambda wc: rkv_bench_args("fig8"),
    log:
        "logs/residualkv/fig8_bench.log",
    benchmark:
        "benchmarks/residualkv/fig8_bench.tsv"
    threads: 2
    resources:
        mem_mb=16000,
        runtime=120,
        gpu=rkv_bench_gpus("fig8"),
    conda:
        "../../envs/kvbench.yaml"
    shell:
        "kvbench bench rkv-throughput --out {output:q} --tokenizer {params.tokenizer:q} --threads {threads} {params.args}"
        " > {log:q} 2>&1"


rule rkv_codec_cost:
    """Fig. 6's measurements: codec cost, SwiGLU encoder + linear decoder vs the reverse, matched parameters
    (the per-step restore through the cache's own read)."""
    output:
        report(
            "results/residualkv/fig6.csv",
            caption="../report/rkv_fig6_data.rst",
            category="ResidualKV",
            subcategory="Figure data",
        ),
    params:
        args=lambda wc: rkv_bench_args("fig6"),
    log:
        "logs/residualkv/fig6_bench.log",
    benchmark:
        "benchmarks/residualkv/fig6_bench.tsv"
    threads: 2
    resources:
        mem_mb=8000,
        runtime=30,
        gpu=rkv_bench_gpus("fig6"),
    conda:
        "../../envs/kvbench.yaml"
    shell:
        "kvbench bench codec-cost --out {output:q} --threads {threads} {params.args} > {log:q} 2>&1"


rule rkv_profile_figure:
    input:
        "results/residualkv/{fig}.csv",
    output:
        report(
            "figures/residualkv/{fig}.pdf",
            caption="../report/rkv_profile_figure.rst",
            category="ResidualKV",
            subcategory="Figures",
        ),
    wildcard_constraints:
        fig="fig8|fig6",
    log:
        "logs/residualkv/{fig}.log",
    benchmark:
        "benchmarks/residualkv/{fig}.tsv"
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
        gpu=0,
    conda:
        "../../envs/kvbench.yaml"
    shell:
        "kvbench report residualkv-{wildcards.fig:q} --raw {input:q} --out {output:q} > {log:q} 2>&1"
