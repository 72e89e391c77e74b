# SCBench's own task files -> multi-query records (ResidualKV Table IV on the paper profile).
# A dataset with `scbench: <task>` names one of SCBench's files under `jsonl:` (microsoft/SCBench data/<task>.jsonl);
# eval reads its conversion data/<profile>/<dataset>-scbench/test.jsonl (common.smk split_file, scbench_split;
# src/kvbench/data/scbench.py: SCDQ prompts, decode budgets and scorers of SCBench's code).

rule scbench_convert:
    input:
        src=lambda wc: local_path(DATASETS[wc.task]["jsonl"]),
    output:
        "data/{profile}/{task}-scbench/test.jsonl",
    wildcard_constraints:
        task=alternation(SCBENCH_DATASETS),
    params:
        scbench=lambda wc: DATASETS[wc.task]["scbench"],
    log:
        "logs/data/{profile}/{task}-scbench.log",
    benchmark:
        "benchmarks/data/{profile}/{task}-scbench.tsv"
    threads: 1
    resources:
        mem_mb=8000,
        runtime=30,
        gpu=0,
    conda:
        "../../envs/kvbench.yaml"
    shell:
        "kvbench scbench-convert --task {params.scbench:q} --src {input.src:q} --out {output:q} > {log:q} 2>&1"
