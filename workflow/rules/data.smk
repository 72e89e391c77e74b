# Materialise one smoke benchmark split (kvbench.data.smoke) into data/<profile>/<task>-<hash>/.
# Datasets given as `jsonl:` files in the config have no rule: eval reads them directly.


rule data:
    input:
        tokenizer=f"{TOKENIZER_DIR}/tokenizer.json",
    output:
        test="data/{profile}/{task}-{recipe}/test.jsonl",
        train="data/{profile}/{task}-{recipe}/train.jsonl",
        meta="data/{profile}/{task}-{recipe}/meta.json",
    wildcard_constraints:
        task=alternation(SMOKE_DATASETS),
    params:
        recipe=lambda wc: check_recipe("data", wc.task, wc.recipe),
        out=lambda wc, output: os.path.dirname(output.test),
        tokenizer=lambda wc, input: os.path.dirname(input.tokenizer),
        seed=SEED,
        n_train=lambda wc: DATASETS[wc.task]["smoke"]["n_train"],
        n_test=lambda wc: DATASETS[wc.task]["smoke"]["n_test"],
    log:
        "logs/data/{profile}/{task}-{recipe}.log",
    benchmark:
        "benchmarks/data/{profile}/{task}-{recipe}.tsv"
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
