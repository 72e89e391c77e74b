# Ours beside the published figures (kvbench.report.compare; docs/workflow.md, "Targets"; docs/decisions/workflow.md, "Ours beside the published figures"): per table
# `results/<paper>/<table>.compare.csv` from the built table and config/published/<paper>.yaml, and one page
# `results/compare.md` over the tables `compare.tables` names ("built": those that exist). Not part of `all`.


rule compare_table:
    input:
        table="results/{table}.csv",
        published=published_file,
    output:
        report(
            "results/{table}.compare.csv",
            caption="../report/compare.rst",
            category=lambda wc: "CONDUIT" if wc.table.startswith("conduit/") else "ResidualKV",
            subcategory="Published comparison",
        ),
    wildcard_constraints:
        table=alternation(COMPARE_TABLES),
    log:
        "logs/compare/{table}.log",
    benchmark:
        "benchmarks/compare/{table}.tsv"
    threads: 1
    resources:
        mem_mb=1000,
        runtime=5,
        gpu=0,
    conda:
        "../../envs/kvbench.yaml"
    shell:
        "kvbench report compare --table {input.table:q} --name {wildcards.table:q} --published {input.published:q}"
        " --out {output:q} > {log:q} 2>&1"


rule compare_page:
    input:
        compare_page_inputs,
    output:
        report(
            "results/compare.md",
            caption="../report/compare_page.rst",
            category="Published comparison",
            subcategory="Summary",
        ),
    log:
        "logs/compare/page.log",
    benchmark:
        "benchmarks/compare/page.tsv"
    threads: 1
    resources:
        mem_mb=1000,
        runtime=5,
        gpu=0,
    conda:
        "../../envs/kvbench.yaml"
    shell:
        "kvbench report compare-page --compare {input:q} --out {output:q} > {log:q} 2>&1"
