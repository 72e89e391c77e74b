# The zoo report: model x task scores of the `full` runs, and the training curves
# (kvbench.report.zoo). Figures are marked for `snakemake --report`.


rule report_zoo:
    input:
        metrics=matrix_metrics(methods=["full"]),
        summaries=[f"{train_dir(m)}/summary.json" for m in REPORT_ZOO_MODELS],
    output:
        table=report(
            "results/{profile}/zoo.csv",
            caption="../report/zoo_table.rst",
            category="Smoke suite",
            subcategory="Tables",
        ),
        timing="results/{profile}/zoo.timing.csv",
    params:
        runs=[run_dir(m, t, k) for m, t, k in matrix_cells(methods=["full"])],
        train=[train_dir(m) for m in REPORT_ZOO_MODELS],
    log:
        "logs/report/{profile}/zoo.log",
    benchmark:
        "benchmarks/report/{profile}/zoo.tsv"
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
        gpu=0,
    conda:
        "../../envs/kvbench.yaml"
    shell:
        "kvbench report zoo --runs {params.runs:q} --train {params.train:q} --out {output.table:q}"
        " --timing-out {output.timing:q} > {log:q} 2>&1"


rule report_zoo_figure:
    input:
        # summary.json is written after the final curves.csv (models.smk).
        summaries=[f"{train_dir(m)}/summary.json" for m in REPORT_ZOO_MODELS],
    output:
        report(
            "figures/{profile}/zoo_training.pdf",
            caption="../report/zoo_training.rst",
            category="Smoke suite",
            subcategory="Figures",
        ),
    params:
        train=[train_dir(m) for m in REPORT_ZOO_MODELS],
    log:
        "logs/report/{profile}/zoo_figure.log",
    benchmark:
        "benchmarks/report/{profile}/zoo_figure.tsv"
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
        gpu=0,
    conda:
        "../../envs/kvbench.yaml"
    shell:
        "kvbench report zoo-figure --train {params.train:q} --out {output:q} > {log:q} 2>&1"
