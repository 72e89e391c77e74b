# CONDUIT premise diagnostics (issue #15 item 3; App. C-D): Tables 11-13.
#
#   conduit_diag_capture  one per backbone x dataset: `kvbench conduit-diagnose` over the first
#                         `conduit_diagnostics.n_records` records, reading the conduit_cache image caches
#                         -> results/conduit/diag/<profile>/<model>/<dataset>.csv (per layer x visual token).
#   Tables 11-13 are `table` jobs (tables.smk) over those captures (kvbench.report.conduit.diagnostics).
# A config without a `conduit_diagnostics:` section has no such targets.


rule conduit_diag_capture:
    input:
        unpack(eval_inputs),
        cache="cache/conduit/{profile}/{model}/{task}/index.json",
    output:
        "results/conduit/diag/{profile}/{model}/{task}.csv",
    params:
        model=lambda wc: model_dir(wc.model),
        cache_dir=conduit_cache_dir,
        args=lambda wc: diag_capture_args(),
    log:
        "logs/conduit/diag/{profile}/{model}/{task}.log",
    benchmark:
        "benchmarks/conduit/diag/{profile}/{model}/{task}.tsv"
    threads: config.get("conduit_diagnostics", {}).get("threads", 1)
    resources:
        mem_mb=model_resource("mem_mb", 4000, 64000),
        runtime=lambda wc: 30 if is_zoo(wc.model) else 240,
        gpu=model_resource("gpus", 0, 1),
    conda:
        "../../envs/kvbench.yaml"
    shell:
        "kvbench conduit-diagnose --model {params.model:q} --model-name {wildcards.model:q} --dataset {wildcards.task:q}"
        " --split {input.split:q} --cache-dir {params.cache_dir:q} --out {output:q} --threads {threads}"
        " {params.args} > {log:q} 2>&1"
