# Beyond both papers (issue #17, deliverable 7): CONDUIT over ResidualKV-compressed image caches
# (kvbench.report.beyond.conduit_rkv_cache.CompressedCachePlan; config `beyond.conduit_rkv_cache`).
#
#   conduit_rkv_cache  one per dataset of Table 1's columns: every image cache of the first `conduit.n_test` records
#                      (rule conduit_cache's, read only) coded in ResidualKV's form with the backbone's VLM codec (rule
#                      rkv_mm_codec) -> cache/conduit_rkv/<profile>/<model>/<dataset>/s-<hash>/index.json (bytes per
#                      image raw vs compressed, restore error)
#   The runs are `eval` jobs (eval.smk) of Table 1's r-block specs reading those caches read-only
#   -> results/runs/<profile>/<model>/<dataset>/conduit-rkv/<slug>/; the raw side is Table 1's own runs. The table
#   results/beyond/conduit_rkv_cache.csv is a `table` job (tables.smk).


rule conduit_rkv_cache:
    input:
        unpack(eval_inputs),
        raw="cache/conduit/{profile}/{model}/{task}/index.json",
        codec=lambda wc: f"{CRC.codec_dir}/codec.json",
    output:
        "cache/conduit_rkv/{profile}/{model}/{task}/{tag}/index.json",
    wildcard_constraints:
        tag=r"s-[0-9a-f]{8}",
    params:
        model=lambda wc: model_dir(wc.model),
        cache_dir=lambda wc, output: os.path.dirname(output[0]),
        source_dir=lambda wc: f"cache/conduit/{wc.profile}/{wc.model}/{_crc_dataset(wc)}",
        compressed=lambda wc: json.dumps(CRC.storage_spec(CRC.codec_dir).to_spec(), sort_keys=True),
        limit=lambda wc: conduit_limit(wc.model),
    log:
        "logs/conduit_rkv/cache/{profile}/{model}/{task}/{tag}.log",
    benchmark:
        "benchmarks/conduit_rkv/cache/{profile}/{model}/{task}/{tag}.tsv"
    threads: config.get("conduit", {}).get("threads", 1)
    resources:
        mem_mb=model_resource("mem_mb", 8000, 64000),
        runtime=lambda wc: 60 if is_zoo(wc.model) else 360,
        gpu=model_resource("gpus", 0, 1),
    conda:
        "../../envs/kvbench.yaml"
    shell:
        "kvbench cache --model {params.model:q} --split {input.split:q} --cache-dir {params.cache_dir:q}"
        " --source-dir {params.source_dir:q} --compressed {params.compressed:q} --out {output:q}"
        " --threads {threads} {params.limit:q} > {log:q} 2>&1"
