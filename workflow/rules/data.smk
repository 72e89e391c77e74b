# Materialise one smoke benchmark split (kvbench.data.smoke) into data/smoke/<task>/.
# Datasets given as `jsonl:` files in the config have no rule: eval reads them directly.


rule data:
    input:
        tokenizer="zoo/tokenizer/tokenizer.json",
    output:
        test="data/smoke/{task}/test.jsonl",
        train="data/smoke/{task}/train.jsonl",
        meta="data/smoke/{task}/meta.json",
    wildcard_constraints:
        task=alternation(SMOKE_DATASETS),
    params:
        out=lambda wc, output: os.path.dirname(output.test),
        tokenizer=lambda wc, input: os.path.dirname(input.tokenizer),
        seed=SEED,
        n_train=lambda wc: DATASETS[wc.task]["smoke"]["n_train"],
        n_test=lambda wc: DATASETS[wc.task]["smoke"]["n_test"],
    log:
        "logs/data/{task}.log",
    benchmark:
        "benchmarks/data/{task}.tsv"
    threads: 1
    resources:
        mem_mb=4000,
        runtime=30,
        gpu=0,
    conda:
        "../../envs/kvbench.yaml"
    shell:
        "kvbench data --task {wildcards.task:q} --tokenizer {params.tokenizer:q} --out {params.out:q}"
        " --seed {params.seed:q} --n-train {params.n_train:q} --n-test {params.n_test:q} > {log:q} 2>&1"
