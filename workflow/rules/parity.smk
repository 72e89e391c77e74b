# Parity with NVIDIA's kvpress (docs/decisions/benchmarks.md, "Parity with kvpress"): `results/parity/kvpress.csv`, a
# target outside `all`. kvbench saves a tiny model, contexts and the mapped parameters and runs its own
# presses (`kvbench parity prepare`); kvpress runs in its own virtual environment (it pins transformers < 5.3),
# built from envs/kvpress-parity.txt by scripts/parity_env.sh (minutes and PyPI, once); the CSV joins both.
# The parity venv and kvpress script are named from the Snakefile's directory; the venv lies under the run's
# working directory (envs/.parity-venv, ignored by git).

PARITY_WORK = "results/parity/work"
PARITY_VENV = "envs/.parity-venv"


localrules:
    parity_env,


rule parity_env:
    input:
        reqs=os.path.join(workflow.basedir, "envs", "kvpress-parity.txt"),
        script=os.path.join(workflow.basedir, "scripts", "parity_env.sh"),
    output:
        f"{PARITY_VENV}/freeze.txt",
    params:
        venv=lambda wc, output: os.path.dirname(output[0]),
    log:
        "logs/parity/env.log",
    benchmark:
        "benchmarks/parity/env.tsv"
    threads: 1
    resources:
        mem_mb=4000,
        runtime=30,
        gpu=0,
    # The rule builds its own venv; the conda env only provides bash and python3.11 under --sdm conda.
    conda:
        "../../envs/kvbench.yaml"
    shell:
        "bash {input.script:q} {params.venv:q} {input.reqs:q} > {log:q} 2>&1"


rule parity_kvbench:
    output:
        plan=f"{PARITY_WORK}/plan.json",
        kvbench=f"{PARITY_WORK}/kvbench.json",
        model=directory(f"{PARITY_WORK}/model"),
    params:
        workdir=lambda wc, output: os.path.dirname(output.plan),
    log:
        "logs/parity/kvbench.log",
    benchmark:
        "benchmarks/parity/kvbench.tsv"
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
        gpu=0,
    conda:
        "../../envs/kvbench.yaml"
    shell:
        "kvbench parity prepare --workdir {params.workdir:q} --threads {threads} > {log:q} 2>&1"


rule parity_kvpress:
    input:
        env=rules.parity_env.output[0],
        plan=rules.parity_kvbench.output.plan,
        model=rules.parity_kvbench.output.model,
        script=os.path.join(workflow.basedir, "scripts", "parity_kvpress.py"),
    output:
        f"{PARITY_WORK}/kvpress.json",
    params:
        python=lambda wc, input: os.path.join(os.path.dirname(input.env), "bin", "python"),
    log:
        "logs/parity/kvpress.log",
    benchmark:
        "benchmarks/parity/kvpress.tsv"
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
        gpu=0,
    conda:
        "../../envs/kvbench.yaml"
    shell:
        "{params.python:q} {input.script:q} --plan {input.plan:q} --out {output:q} --threads {threads} > {log:q} 2>&1"


rule parity_csv:
    input:
        plan=rules.parity_kvbench.output.plan,
        kvbench=rules.parity_kvbench.output.kvbench,
        kvpress=rules.parity_kvpress.output[0],
    output:
        report(
            "results/parity/kvpress.csv",
            caption="../report/parity.rst",
            category="Parity",
            subcategory="Tables",
        ),
    params:
        workdir=lambda wc, input: os.path.dirname(input.plan),
    log:
        "logs/parity/csv.log",
    benchmark:
        "benchmarks/parity/csv.tsv"
    threads: 1
    resources:
        mem_mb=1000,
        runtime=5,
        gpu=0,
    conda:
        "../../envs/kvbench.yaml"
    shell:
        "kvbench parity compare --workdir {params.workdir:q} --out {output:q} > {log:q} 2>&1"
