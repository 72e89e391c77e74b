# Evaluate one model on one split with one method (kvbench.eval.runner): every run of the config, one rule.
# The runs are the eval matrix (results/runs/<profile>/<model>/<task>/<slug>/), the CONDUIT plan's
# (.../conduit/<slug>/) and the ResidualKV plan's (.../residualkv/<slug>/); `{run}` is that name and
# common.smk's RUNS says which spec, resource (image cache, codec), threads and record limit it has.
# The model is zoo/<profile>/<model>-<hash>/ (trained by models.smk) or a local checkpoint; the split is
# data/<profile>/<task>-<hash>/test.jsonl (data.smk) or a local JSONL file.


rule eval:
    input:
        unpack(run_inputs),
    output:
        metrics="results/runs/{profile}/{model}/{task}/{run}/metrics.json",
        predictions="results/runs/{profile}/{model}/{task}/{run}/predictions.jsonl",
        run_info="results/runs/{profile}/{model}/{task}/{run}/run_info.json",
        timing="results/runs/{profile}/{model}/{task}/{run}/timing.csv",  # latency per record (wall-clock, kept out of the results)
    wildcard_constraints:
        run=alternation(RUN_NAMES),
    params:
        model=lambda wc: model_dir(wc.model),
        spec=lambda wc: run_of(wc)[1].spec,
        method_params=run_method_params,
        out=lambda wc, output: os.path.dirname(output.metrics),
        seed=SEED,
        limit=run_limit,
    log:
        "logs/eval/{profile}/{model}/{task}/{run}.log",
    benchmark:
        "benchmarks/eval/{profile}/{model}/{task}/{run}.tsv"
    threads: run_threads
    resources:
        mem_mb=model_resource("mem_mb", 8000, 64000),
        runtime=run_runtime,
        gpu=model_resource("gpus", 0, 1),
    conda:
        "../../envs/kvbench.yaml"
    shell:
        "kvbench eval --model {params.model:q} --split {input.split:q} --method {params.spec:q}"
        " --method-params {params.method_params:q} --out {params.out:q} --seed {params.seed:q}"
        " --threads {threads} {params.limit:q} > {log:q} 2>&1"


localrules:
    runs,


rule runs:
    """Every run of the eval matrix (all configured methods)."""
    input:
        matrix_metrics(),
