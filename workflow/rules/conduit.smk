# CONDUIT accuracy targets (issue #3): the image caches refresh runs read, and Figure 3.
#
#   conduit_cache  one per model x dataset: every image of the first `conduit.n_test` records prefilled
#                  alone under its generic prefix -> cache/conduit/<profile>/<model>/<dataset>/ (index.json
#                  is the declared output; the store entries are content-addressed and survive reruns).
#   The refresh runs are `eval` jobs (eval.smk) reading that cache read-only
#   -> results/runs/<profile>/<model>/<dataset>/conduit/<slug>/ (predictions with plans); the tables
#   (results/conduit/table{1,2,4,5}.csv, staleness_gap.csv) are `table` jobs (tables.smk).
#   conduit_fig3   figures/conduit/fig3.pdf (+ results/conduit/fig3.csv, the plotted numbers).
#   conduit_fig4   figures/conduit/fig4.pdf (+ results/conduit/fig4.csv): the case study of Table 15.
# Which runs a target reads is decided by kvbench.report.conduit.accuracy.ConduitPlan, for the rules and the
# report alike (helpers: common.smk, "CONDUIT accuracy targets"). A config without a `conduit:`
# section has no CONDUIT targets (asking for one fails naming the missing section).

rule conduit_cache:
    input:
        unpack(eval_inputs),
    output:
        "cache/conduit/{profile}/{model}/{task}/index.json",
    params:
        model=lambda wc: model_dir(wc.model),
        cache_dir=conduit_cache_dir,
        limit=lambda wc: conduit_limit(wc.model),
    log:
        "logs/conduit/cache/{profile}/{model}/{task}.log",
    benchmark:
        "benchmarks/conduit/cache/{profile}/{model}/{task}.tsv"
    threads: config.get("conduit", {}).get("threads", 1)
    resources:
        mem_mb=model_resource("mem_mb", 8000, 64000),
        runtime=lambda wc: 60 if is_zoo(wc.model) else 360,
        gpu=model_resource("gpus", 0, 1),
    conda:
        "../../envs/kvbench.yaml"
    shell:
        "kvbench cache --model {params.model:q} --split {input.split:q} --cache-dir {params.cache_dir:q}"
        " --out {output:q} --threads {threads} {params.limit:q} > {log:q} 2>&1"


rule conduit_fig3:
    input:
        lambda wc: conduit_plan().target_inputs("fig3"),
    output:
        pdf=report(
            "figures/conduit/fig3.pdf",
            caption="../report/conduit_fig3.rst",
            category="CONDUIT",
            subcategory="Figures",
        ),
        csv=report(
            "results/conduit/fig3.csv",
            caption="../report/conduit_fig3_data.rst",
            category="CONDUIT",
            subcategory="Figure data",
        ),
    params:
        spec=lambda wc: conduit_plan().report_spec("fig3"),
    log:
        "logs/conduit/fig3.log",
    benchmark:
        "benchmarks/conduit/fig3.tsv"
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
        gpu=0,
    conda:
        "../../envs/kvbench.yaml"
    shell:
        "kvbench report conduit-fig3 --conduit {params.spec:q} --out {output.pdf:q} --data-out {output.csv:q} > {log:q} 2>&1"


rule conduit_fig4:
    input:
        lambda wc: conduit_plan().target_inputs("fig4"),
    output:
        pdf=report(
            "figures/conduit/fig4.pdf",
            caption="../report/conduit_fig4.rst",
            category="CONDUIT",
            subcategory="Figures",
        ),
        csv=report(
            "results/conduit/fig4.csv",
            caption="../report/conduit_fig4_data.rst",
            category="CONDUIT",
            subcategory="Figure data",
        ),
    params:
        spec=lambda wc: conduit_plan().report_spec("fig4"),
    log:
        "logs/conduit/fig4.log",
    benchmark:
        "benchmarks/conduit/fig4.tsv"
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
        gpu=0,
    conda:
        "../../envs/kvbench.yaml"
    shell:
        "kvbench report conduit-fig4 --conduit {params.spec:q} --out {output.pdf:q} --data-out {output.csv:q} > {log:q} 2>&1"


localrules:
    conduit,


rule conduit:
    """Every CONDUIT accuracy target of the config (Tables 1, 2, 4, 5, 14, 15, the staleness gap, Figures 3 and 4; with a
    `conduit_diagnostics:` section also Tables 11-13)."""
    input:
        lambda wc: conduit_plan() and aggregate_targets("conduit"),
