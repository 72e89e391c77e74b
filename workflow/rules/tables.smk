# Every table of both papers, one rule: `results/<paper>/<table>.csv` from the runs (or raw CSV) it reads.
# The tables are kvbench.report.tables.TABLES (one `Table` entry each: title, caption, rows, writer); common.smk
# ("Runs and tables") gives each its inputs and the JSON its writer reads. A config without a table's section
# has no such target (asking for it fails naming the section).


rule table:
    input:
        table_inputs,
    output:
        report(
            "results/{table}.csv",
            caption="../report/table.rst",
            category=lambda wc: table_of(wc.table).paper,
            subcategory="Tables",
        ),
    wildcard_constraints:
        table=alternation(TABLES),
    params:
        spec=table_spec,
        caption=lambda wc: table_of(wc.table).caption,
    log:
        "logs/tables/{table}.log",
    benchmark:
        "benchmarks/tables/{table}.tsv"
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
        gpu=0,
    conda:
        "../../envs/kvbench.yaml"
    shell:
        "kvbench report {wildcards.table:q} --spec {params.spec:q} --out {output:q} > {log:q} 2>&1"
