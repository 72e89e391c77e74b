# Train one tiny zoo model (kvbench.train.zoo) into zoo/<profile>/<model>-<hash>/.
#
# The hash is the model's recipe (common.smk, kvbench.utils.recipe): a config change trains into a new
# directory and never deletes a finished one. Training always runs every step of the recipe; the
# optional `zoo.slice_s` only ends one invocation (state saved, the job fails with exit 3 saying how
# many steps are done; rerunning resumes to the same weights). The trained model must then reach its
# skill floors (`zoo.floors`) on a validation slice, or the job fails naming the task, floor and the
# targets it feeds. Training state (zoo/<profile>/.train/<model>-<hash>/state/, curves.csv) is
# deliberately NOT a declared output, so Snakemake never deletes it. The declared outputs are written
# once, at the end, summary.json last. Progress lines reach the console and the log.
# Why not protected()/update()/--keep-incomplete: docs/decisions/workflow.md, "Resumable state is not a declared output".
# A model named `<zoo entry>-s<k>` is a seed replica: the entry's architecture and recipe trained with its
# `zoo.seed: k` (config/confirm.yaml); where its recipe shares warm-up phases (kvbench.train.recipes.SHARED_WARMUP), it
# starts from the state its entry kept after them (<entry workdir>/warmup/) instead of step 0. Models given as `checkpoint:` in the config have no rule: eval reads them.


rule train:
    input:
        tokenizer=f"{TOKENIZER_DIR}/tokenizer.json",
        entry=lambda wc: warm_start_input(wc.model),  # a seed replica: its entry, which keeps the warm-up state
    output:
        config="zoo/{profile}/{model}-{recipe}/config.json",
        summary="zoo/{profile}/.train/{model}-{recipe}/summary.json",
    wildcard_constraints:
        model=alternation(ZOO_MODELS),
    params:
        recipe=lambda wc: check_recipe("model", wc.model, wc.recipe),
        out=lambda wc, output: os.path.dirname(output.config),
        workdir=lambda wc, output: os.path.dirname(output.summary),
        tokenizer=lambda wc, input: os.path.dirname(input.tokenizer),
        seed=lambda wc: model_seed(wc.model),  # per-model for seed replicas (config/confirm.yaml)
        overrides=lambda wc: train_overrides(wc.model),
        floors=lambda wc: json.dumps(MODELS[wc.model]["zoo"]["floors"], sort_keys=True),
        val_n=lambda wc: MODELS[wc.model]["zoo"]["val_n"],
        feeds=lambda wc: model_feeds(wc.model),
        # the recipe's thread count, not {threads}: Snakemake scales {threads} down to --cores, and another thread
        # count trains other bytes than the recipe hash names (the job then shares fewer cores, with the same result)
        threads=lambda wc: MODELS[wc.model]["zoo"]["threads"],
        args=lambda wc: warm_start_args(wc.model),  # "" or ` --warm-start <quoted dir>` (a seed replica)
    log:
        "logs/train/{profile}/{model}-{recipe}.log",
    benchmark:
        "benchmarks/train/{profile}/{model}-{recipe}.tsv"
    threads: lambda wc: MODELS[wc.model]["zoo"]["threads"]
    resources:
        mem_mb=8000,
        runtime=lambda wc: MODELS[wc.model]["zoo"]["runtime_min"],
        gpu=0,
        # A resource, not a param: changing the slice must not rerun (and first delete) a finished model.
        slice_s=lambda wc: MODELS[wc.model]["zoo"]["slice_s"] or 0,  # seconds; 0: no slice
    conda:
        "../../envs/kvbench.yaml"
    shell:
        "kvbench train --model {wildcards.model:q} --tokenizer {params.tokenizer:q} --out {params.out:q}"
        " --workdir {params.workdir:q} --slice-s {resources.slice_s:q} --seed {params.seed:q} --threads {params.threads:q}"
        " --overrides {params.overrides:q} --floors {params.floors:q} --val-n {params.val_n:q}"
        " --feeds {params.feeds:q}{params.args} 2>&1 | tee {log:q}"
