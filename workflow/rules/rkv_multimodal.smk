# ResidualKV Table II (issue #17): the codec of each VLM backbone for its ResidualKV rows. Runs and the table are the
# `eval` and `table` rules (common.smk, "Runs and tables"; kvbench.report.residualkv.table_ii.MMPlan).
#
#   rkv_mm_codec    one per backbone of `residualkv.tableII.models`: `kvbench codec-train --data vlm` on its own image
#                   records (the tasks' train splits, or `tableII.codec.data_files`), visual tokens included
#                   -> codecs/<profile>/<model>/mm-<recipe hash>/{codec/,curves.csv,summary.json}


rule rkv_mm_codec:
    input:
        model=lambda wc: os.path.join(model_dir(wc.model), "config.json"),
        data=lambda wc: MM.codec_files(),
    output:
        codec="codecs/{profile}/{model}/{mmcodec}/codec/codec.json",
        summary="codecs/{profile}/{model}/{mmcodec}/summary.json",
    wildcard_constraints:
        mmcodec=r"mm-[0-9a-f]{8}",
        model=alternation(mm_codec_models()),
    params:
        model=lambda wc: model_dir(wc.model),
        out=lambda wc, output: os.path.dirname(output.summary),
        overrides=lambda wc: json.dumps(MM.section["codec"].get("config", {}), sort_keys=True),
        train=lambda wc: MM.section["codec"]["train"],
        recipe=lambda wc: mm_check_codec(wc),
        args=lambda wc: MM.codec_flags(),  # shell-quoted flags
        seed=SEED,
    log:
        "logs/residualkv/codec/{profile}/{model}/{mmcodec}.log",
    benchmark:
        "benchmarks/residualkv/codec/{profile}/{model}/{mmcodec}.tsv"
    # `tableII.codec.train.threads` (default 1: the same bytes every run; outside the recipe hash, as the LM codecs')
    threads: lambda wc: MM.section["codec"]["train"].get("threads", 1)
    resources:
        mem_mb=model_resource("mem_mb", 8000, 64000),
        runtime=lambda wc: 120 if is_zoo(wc.model) else 24 * 60,
        gpu=lambda wc: MM.codec_gpus(),
    conda:
        "../../envs/kvbench.yaml"
    shell:
        "kvbench codec-train --model {params.model:q} --out {params.out:q} --overrides {params.overrides:q}"
        " --objective {params.train[objective]:q} --steps {params.train[steps]:q} --lr {params.train[lr]:q}"
        " --data vlm --data-files {input.data:q} --seed {params.seed:q} --threads {threads} {params.args}"
        " > {log:q} 2>&1"
