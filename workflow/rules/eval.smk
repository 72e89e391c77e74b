# Evaluate one model on one split with one method (kvbench.eval.runner).
# The model is zoo/<profile>/<model>-<hash>/ (trained by models.smk) or a local checkpoint;
# the split is data/<profile>/<task>-<hash>/test.jsonl (data.smk) or a local JSONL file.



rule eval:
    input:
        unpack(eval_inputs),
    output:
        metrics="results/runs/{profile}/{model}/{task}/{method}/metrics.json",
        predictions="results/runs/{profile}/{model}/{task}/{method}/predictions.jsonl",
        run_info="results/runs/{profile}/{model}/{task}/{method}/run_info.json",
        timing="results/runs/{profile}/{model}/{task}/{method}/timing.csv",  # latency per record (wall-clock, kept out of the results)
    params:
        model=lambda wc: model_dir(wc.model),
        out=lambda wc, output: os.path.dirname(output.metrics),
        seed=SEED,
        limit=lambda wc: [] if config["eval"]["limit"] is None else ["--limit", config["eval"]["limit"]],
    log:
        "logs/eval/{profile}/{model}/{task}/{method}.log",
    benchmark:
        "benchmarks/eval/{profile}/{model}/{task}/{method}.tsv"
    threads: config["eval"]["threads"]
    resources:
        mem_mb=lambda wc: MODELS[wc.model].get("mem_mb", 8000 if is_zoo(wc.model) else 64000),
        runtime=lambda wc: 60 if is_zoo(wc.model) else 360,
        gpu=lambda wc: MODELS[wc.model].get("gpus", 0 if is_zoo(wc.model) else 1),
    conda:
        "../../envs/kvbench.yaml"
    shell:
        "kvbench eval --model {params.model:q} --split {input.split:q} --method {wildcards.method:q}"
        " --out {params.out:q} --seed {params.seed:q} --threads {threads} {params.limit:q} > {log:q} 2>&1"


localrules:
    runs,


rule runs:
    """Every run of the eval matrix (all configured methods)."""
    input:
        matrix_metrics(),
