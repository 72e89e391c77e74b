# ResidualKV Fig. 13 (issue #17): the visual case, which earlier tokens each visual token of one image is coded against.
#
#   rkv_visual_case  results/residualkv/fig13.csv: `kvbench analyze rkv-visual-case` on record `residualkv.fig13.record`
#                    of the task's test split through the VLM, the references as Table II's ResidualKV row stores them
#                    with its codec (rule rkv_mm_codec, codecs/<profile>/<model>/mm-<hash>/codec/): its schedule (k,
#                    n_sink, stride, alpha, grid), FP8 pool, full layers (kvbench.compress.residualkv.visual_case)
#   rkv_fig13        figures/residualkv/fig13.pdf + results/residualkv/fig13_summary.csv (shares of references that are
#                    patches of the image / text, beside chance; per layer) from that CSV and the record's image
# Its helper functions: rkv_fig13_common.smk. A config without `residualkv.fig13` has neither (asked for by name, the
# target fails naming the key); `residualkv.fig13` needs `residualkv.tableII` (its codec and ResidualKV row).


include: "rkv_fig13_common.smk"


rule rkv_visual_case:
    """Fig. 13's data: one record's visual tokens and, in each drawn layer, the references the ResidualKV cache stores
    for them (schedule, FP8 pool and full layers of Table II's ResidualKV row and codec of the model)."""
    input:
        unpack(rkv_fig13_inputs),
    output:
        report(
            "results/residualkv/fig13.csv",
            caption="../report/rkv_fig13_data.rst",
            category="ResidualKV",
            subcategory="Figure data",
        ),
    params:
        model=lambda wc: model_dir(rkv_fig13()["model"]),
        name=lambda wc: rkv_fig13()["model"],
        split=lambda wc, input: f"{rkv_fig13()['task']}={input.split}",
        codec=lambda wc, input: os.path.dirname(input.codec),
        method=lambda wc: rkv_fig13()["method"],
        profile=PROFILE,
        args=lambda wc: rkv_fig13_args(),  # shell-quoted flags
    log:
        "logs/residualkv/fig13_visual_case.log",
    benchmark:
        "benchmarks/residualkv/fig13_visual_case.tsv"
    threads: 1
    resources:
        mem_mb=lambda wc: MODELS[rkv_fig13()["model"]].get("mem_mb", 4000 if is_zoo(rkv_fig13()["model"]) else 64000),
        runtime=lambda wc: 20 if is_zoo(rkv_fig13()["model"]) else 60,
        gpu=lambda wc: 1 if str(rkv_fig13()["device"]).startswith("cuda") else 0,
    conda:
        "../../envs/kvbench.yaml"
    shell:
        "kvbench analyze rkv-visual-case --model {params.model:q} --model-name {params.name:q} --split {params.split:q}"
        " --method {params.method:q} --codec-dir {params.codec:q} --out {output:q} --profile {params.profile:q}"
        " {params.args} --threads {threads} > {log:q} 2>&1"


rule rkv_fig13:
    input:
        data="results/residualkv/fig13.csv",
        split=lambda wc: rkv_fig13_inputs(wc)["split"],
    output:
        pdf=report(
            "figures/residualkv/fig13.pdf",
            caption="../report/rkv_fig13.rst",
            category="ResidualKV",
            subcategory="Figures",
        ),
        summary=report(
            "results/residualkv/fig13_summary.csv",
            caption="../report/rkv_fig13_data.rst",
            category="ResidualKV",
            subcategory="Figure data",
        ),
    params:
        queries=lambda wc: rkv_fig13()["queries"],
    log:
        "logs/residualkv/fig13.log",
    benchmark:
        "benchmarks/residualkv/fig13.tsv"
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
        gpu=0,
    conda:
        "../../envs/kvbench.yaml"
    shell:
        "kvbench report residualkv-fig13 --raw {input.data:q} --split {input.split:q} --queries {params.queries:q}"
        " --out {output.pdf:q} --data-out {output.summary:q} > {log:q} 2>&1"
