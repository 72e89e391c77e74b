# CONDUIT Table 3 (issue #3): prefill FLOPs and time to first token, full prefill vs. each refresh method.
#
#   conduit_latency  `kvbench bench conduit-latency`: raw measurements, one row per (context size, method,
#                    repeat) -> results/bench/<profile>/conduit_latency.csv
#   Table 3 itself is a `table` job (tables.smk: `kvbench report conduit/table3`) -> results/conduit/table3.csv
#                    (results/table3.csv is its short name, targets.smk)
# `conduit_latency.model` is a timing model of kvbench.bench.timing_model (random weights, built in memory;
# needs only the zoo tokenizer) or a `models:` entry with a checkpoint (kvbench.bench.workflow). The timing
# job wants the machine to itself: it declares all the config's threads and is not part of `all`. A config
# without a `conduit_latency:` section has no Table 3 target (asking for it fails naming the section).

from kvbench.bench.workflow import latency_job

if "conduit_latency" in config:  # a value the bench would refuse fails here, before Snakemake removes the old CSV
    latency_job(config, model_dir, TOKENIZER_DIR)


rule conduit_latency:
    input:
        model=lambda wc: latency_job(config, model_dir, TOKENIZER_DIR).input,
    output:
        "results/bench/{profile}/conduit_latency.csv",
    params:
        args=lambda wc: latency_job(config, model_dir, TOKENIZER_DIR).args,
    log:
        "logs/bench/{profile}/conduit_latency.log",
    benchmark:
        "benchmarks/bench/{profile}/conduit_latency.tsv"
    threads: config.get("conduit_latency", {}).get("threads", 1)
    resources:
        mem_mb=16000,
        runtime=60,
        gpu=config.get("conduit_latency", {}).get("gpus", 0),
    conda:
        "../../envs/kvbench.yaml"
    shell:
        "kvbench bench conduit-latency --out {output:q} {params.args} > {log:q} 2>&1"


