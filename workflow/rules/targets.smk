# Short target names (docs/workflow.md, "Targets"): a copy of the namespaced canonical target.
#   results/table<N>.csv      (Arabic)  <- results/conduit/table<N>.csv      (CONDUIT)
#   results/table<ROMAN>.csv  (Roman)   <- results/residualkv/table<ROMAN>.csv (ResidualKV)
#   figures/fig<N>.pdf, N in 5,6,8,10,11,12,13 <- figures/residualkv/fig<N>.pdf (Fig. 9 is not built; CONDUIT has no
#                             Fig. 5-13, so these short names are unambiguous)
#   figures/fig3.pdf, fig4.pdf: both papers have them, so the short name fails
#   while the DAG is built (also under -n), naming the canonical targets that exist
#   (fig3: figures/conduit/fig3.pdf and figures/residualkv/fig3.pdf; fig4: CONDUIT's only).
# A canonical target without a producing rule fails with Snakemake's
# MissingInputException naming it; nothing here fabricates content.

localrules:
    conduit_table_alias,
    residualkv_table_alias,
    residualkv_figure_alias,
    ambiguous_figure_alias,


rule conduit_table_alias:
    input:
        "results/conduit/table{n}.csv",
    output:
        "results/table{n}.csv",
    wildcard_constraints:
        n=r"[1-9][0-9]*",
    log:
        "logs/targets/table{n}.log",
    benchmark:
        "benchmarks/targets/table{n}.tsv"
    threads: 1
    resources:
        mem_mb=100,
        runtime=5,
        gpu=0,
    conda:
        "../../envs/kvbench.yaml"
    shell:
        "cp {input:q} {output:q} 2> {log:q}"


rule residualkv_table_alias:
    input:
        "results/residualkv/table{n}.csv",
    output:
        "results/table{n}.csv",
    wildcard_constraints:
        n=alternation(residualkv_table_numerals()),
    log:
        "logs/targets/table{n}.log",
    benchmark:
        "benchmarks/targets/table{n}.tsv"
    threads: 1
    resources:
        mem_mb=100,
        runtime=5,
        gpu=0,
    conda:
        "../../envs/kvbench.yaml"
    shell:
        "cp {input:q} {output:q} 2> {log:q}"


rule residualkv_figure_alias:
    input:
        "figures/residualkv/fig{n}.pdf",
    output:
        "figures/fig{n}.pdf",
    wildcard_constraints:
        n=alternation(RESIDUALKV_ONLY_FIGURES),
    log:
        "logs/targets/fig{n}.log",
    benchmark:
        "benchmarks/targets/fig{n}.tsv"
    threads: 1
    resources:
        mem_mb=100,
        runtime=5,
        gpu=0,
    conda:
        "../../envs/kvbench.yaml"
    shell:
        "cp {input:q} {output:q} 2> {log:q}"


rule ambiguous_figure_alias:
    """Never runs: its input function raises while the DAG is built."""
    input:
        ambiguous_figure,
    output:
        "figures/fig{n}.pdf",
    wildcard_constraints:
        n=alternation(AMBIGUOUS_FIGURES),
    log:
        "logs/targets/fig{n}.log",
    benchmark:
        "benchmarks/targets/fig{n}.tsv"
    threads: 1
    resources:
        mem_mb=100,
        runtime=5,
        gpu=0,
    conda:
        "../../envs/kvbench.yaml"
    shell:
        "false"
