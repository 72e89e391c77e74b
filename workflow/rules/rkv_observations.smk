# ResidualKV Table I and Fig. 3 (issue #17): what the backbones and their K/V are, rather than runs over them.
#
#   table (tables.smk)  results/residualkv/tableI.csv: each model's config.json (2 d_k, layers), the main codec's
#                       codec.json (d_c, d_ff), Table III's ResidualKV row (full layers), the published values beside
#                       them (kvbench.report.residualkv.table_i); its inputs and spec: rkv_observations_common.smk
#   rkv_observations    results/residualkv/fig3.csv: `kvbench analyze rkv-observations` over the first contexts of the
#                       `residualkv.fig3` tasks' test splits (kvbench.compress.residualkv.observations)
#   rkv_fig3            figures/residualkv/fig3.pdf + results/residualkv/fig3_summary.csv (the two headline numbers
#                       beside the paper's) from that CSV
# Their helper functions: rkv_observations_common.smk.
# A config without a `residualkv:` section has none of them.

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
        " --out {output:q} --profile {params.profile:q} {params.args} --threads {threads} > {log:q} 2>&1"


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
