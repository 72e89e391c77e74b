"""kvbench: the reproducibility pipeline for CONDUIT and ResidualKV.

Read top-down: config -> validation -> rule files (workflow/rules/) ->
`kvbench <verb>` (src/kvbench/cli.py). Targets: docs/workflow.md.
"""
import os
import re
import sys

from snakemake.utils import min_version, validate

min_version("9.27")


# The default profile is config/config.yaml. A `--configfile` given on the
# command line REPLACES it rather than being merged into it (Snakemake's own
# behaviour would merge, leaking the smoke zoo into config/paper.yaml); the
# path is anchored at the Snakefile so `--directory` works.
if not workflow.overwrite_configfiles:

    configfile: os.path.join(workflow.basedir, "config", "config.yaml")


validate(config, "workflow/schemas/config.schema.yaml")

envvars:
    "PATH",


# Rules call `kvbench` from PATH. Put the interpreter running Snakemake first, so
# `.venv/bin/snakemake` works without activating the venv; with `--sdm conda`
# Snakemake activates the rule's env, whose bin/ then comes first.
os.environ["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])


include: "workflow/rules/common.smk"


# Wildcards only ever take configured names, so model/task names with dots
# (tiny-qwen2.5-vl) never split across path components.
wildcard_constraints:
    profile=re.escape(PROFILE),
    model=alternation(MODELS),
    task=alternation(DATASETS),
    recipe=r"[0-9a-f]{8}",


include: "workflow/rules/tokenizer.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/scbench.smk"
include: "workflow/rules/models.smk"
include: "workflow/rules/eval.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/conduit.smk"
include: "workflow/rules/conduit_latency.smk"
include: "workflow/rules/conduit_diag.smk"
include: "workflow/rules/residualkv.smk"
include: "workflow/rules/rkv_observations_common.smk"
include: "workflow/rules/rkv_observations.smk"
include: "workflow/rules/rkv_multimodal.smk"
include: "workflow/rules/rkv_fig13.smk"
include: "workflow/rules/conduit_rkv_cache_common.smk"
include: "workflow/rules/conduit_rkv_cache.smk"
include: "workflow/rules/tables.smk"
include: "workflow/rules/targets.smk"
include: "workflow/rules/parity.smk"
include: "workflow/rules/compare.smk"


localrules:
    all,


# `snakemake --report report.html` reports what has been built (common.smk, "The report").
rule all:
    default_target: True
    input:
        built_report_files() if report_only() else default_targets(),
