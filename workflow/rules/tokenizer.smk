# The zoo's offline byte-level BPE tokenizer (kvbench.data.tokenizer), in zoo/<profile>/tokenizer-<hash>/.
# Output: tokenizer.json stands for the save_pretrained directory (docs/decisions/workflow.md, "Tokenizer output").


rule tokenizer:
    output:
        "zoo/{profile}/tokenizer-{recipe}/tokenizer.json",
    params:
        recipe=lambda wc: check_recipe("tokenizer", "tokenizer", wc.recipe),
        out=lambda wc, output: os.path.dirname(output[0]),
        vocab_size=config["zoo"]["tokenizer"]["vocab_size"],
    log:
        "logs/tokenizer/{profile}/tokenizer-{recipe}.log",
    benchmark:
        "benchmarks/tokenizer/{profile}/tokenizer-{recipe}.tsv"
    threads: 1
    resources:
        mem_mb=4000,
        runtime=15,
        gpu=0,
    conda:
        "../../envs/kvbench.yaml"
    shell:
        "kvbench tokenizer --out {params.out:q} --vocab-size {params.vocab_size:q} > {log:q} 2>&1"
