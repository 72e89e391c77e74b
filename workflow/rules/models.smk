# Train one tiny zoo model (kvbench.train.zoo) into zoo/<model>/.
#
# Training is resumable: its state (zoo/.train/<model>/state/ and the loss
# curve zoo/.train/<model>/curves.csv, which a resumed run extends) is
# deliberately NOT a declared output, so Snakemake never deletes it: not
# before a rerun, not after a failure. Rerunning after an interruption resumes
# from it. The declared outputs are written once, at the end, summary.json
# last (after the final curves.csv), so consumers of the curves depend on it.
# Why not protected()/update()/--keep-incomplete: docs/decisions.md, "Workflow".
# Models given as `checkpoint:` in the config have no rule: eval reads them.


rule train:
    input:
        tokenizer="zoo/tokenizer/tokenizer.json",
    output:
        config="zoo/{model}/config.json",
        summary="zoo/.train/{model}/summary.json",
    wildcard_constraints:
        model=alternation(ZOO_MODELS),
    params:
        out=lambda wc, output: os.path.dirname(output.config),
        workdir=lambda wc, output: os.path.dirname(output.summary),
        tokenizer=lambda wc, input: os.path.dirname(input.tokenizer),
        budget_s=lambda wc: MODELS[wc.model]["zoo"]["budget_s"],
        seed=SEED,
        overrides=lambda wc: train_overrides(wc.model),
    log:
        "logs/train/{model}.log",
    benchmark:
        "benchmarks/train/{model}.tsv"
    threads: lambda wc: MODELS[wc.model]["zoo"]["threads"]
    resources:
        mem_mb=8000,
        runtime=lambda wc: int(MODELS[wc.model]["zoo"]["budget_s"] // 60) + 30,
        gpu=0,
    conda:
        "../../envs/kvbench.yaml"
    shell:
        "kvbench train --model {wildcards.model:q} --tokenizer {params.tokenizer:q} --out {params.out:q}"
        " --workdir {params.workdir:q} --budget-s {params.budget_s:q} --seed {params.seed:q}"
        " --threads {threads} --overrides {params.overrides:q} > {log:q} 2>&1"
