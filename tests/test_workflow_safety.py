"""Config values reach a rule's shell command as single arguments, never as shell syntax (issue #11, item 6).

One dry run (``-n -p``) builds every rule that has a command from a config whose free-text values (the
data root, checkpoint and JSONL paths, Fig. 8's model and codec directory) hold spaces, ``;``, ``#``,
``$(...)`` and backquotes; every printed command must split (``shlex.split``) into arguments that keep each
such path whole, and running it with ``kvbench``/``cp`` stubbed out must execute nothing else. Values that
cannot be quoted into meaning (a refresh policy, a device) are refused while the DAG is built, naming the
config key, before Snakemake would remove the previous output.
"""
from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from kvbench.bench.workflow import TIMED_METHODS, latency_job
from test_rkv_deltakv_format import write_theirs
from test_workflow import CONFIG, REPO, load, snakemake, write_config

# A shell that ran any of these unquoted would create a file named pwned.
ROOT_NAME = "kv data;touch pwned #"
LM_CKPT = "checkpoints/lm $(touch pwned)"
VLM_CKPT = "checkpoints/vlm `touch pwned`"
DOC_JSONL = "benchmarks/doc;touch pwned.jsonl"
TEXT_JSONL = "benchmarks/text $(touch pwned).jsonl"
SCB_JSONL = "benchmarks/scbench/kv 'touch pwned'.jsonl"   # one of SCBench's own files (rule scbench_convert)
COMPRESSOR = "compressors/their `touch pwned` dir"
# The zoo LM's KV shape (8 layers, 2 KV heads of 32): the ResidualKV plan checks the smoke codecs against it.
LM_SHAPE = {"num_hidden_layers": 8, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}
TARGETS = ["all", "conduit", "residualkv", "results/table3.csv", "results/table1.csv", "results/tableIII.csv",
           "figures/fig8.pdf", "results/compare.md", "results/beyond/conduit_rkv_cache.csv"]


def _hostile_config(tmp_path: Path) -> tuple[dict, Path]:
    """The smoke config plus checkpoint models and JSONL datasets under a hostile root, feeding every rule."""
    root = tmp_path / ROOT_NAME
    for ckpt, shape in ((LM_CKPT, LM_SHAPE), (VLM_CKPT, {})):
        (root / ckpt).mkdir(parents=True)
        (root / ckpt / "config.json").write_text(json.dumps(shape))
    for split in (DOC_JSONL, TEXT_JSONL, SCB_JSONL):
        (root / split).parent.mkdir(parents=True, exist_ok=True)
        (root / split).write_text("{}\n")
    cfg = load(CONFIG)
    cfg["paths"] = {"root": str(root)}
    cfg["models"].update({"ckpt-lm": {"kind": "lm", "checkpoint": LM_CKPT},
                          "ckpt-vlm": {"kind": "vlm", "checkpoint": VLM_CKPT}})
    cfg["datasets"].update({"doc-jsonl": {"kind": "vlm", "jsonl": DOC_JSONL},
                            "text-jsonl": {"kind": "text", "jsonl": TEXT_JSONL},
                            "scb-jsonl": {"kind": "text", "jsonl": SCB_JSONL, "scbench": "scbench_kv"}})
    cfg["eval"]["matrix"] = {"tiny-qwen2-lm": ["niah_1k"], "tiny-qwen2.5-vl": ["docpages"],
                             "ckpt-lm": ["text-jsonl"], "ckpt-vlm": ["doc-jsonl"]}
    cfg["conduit"].update(models=["ckpt-vlm"], regimes={}, multi_image={"K8": {"dataset": "doc-jsonl"}},
                          single_image={"K1": {"dataset": "doc-jsonl"}})
    cfg["conduit_diagnostics"]["datasets"] = {"doc-jsonl": "page", "docpages": "grid"}   # Table 13 needs two types
    cfg["conduit_latency"]["model"] = "ckpt-vlm"
    cfg["residualkv"].update(model="ckpt-lm", tasks=["text-jsonl"], target_tasks={"tableIV": ["scb-jsonl"]})
    cfg["residualkv"]["fig8"].update(model=str(root / LM_CKPT), codec_dir=str(root / "codec dir;touch pwned"))
    # the main codec imported from an authors' compressor under a hostile name (rule rkv_codec_import); the
    # variants still train (rkv_codec)
    write_theirs(root / COMPRESSOR, dict(LM_SHAPE, head_dim=32), bias=False, d_c=cfg["residualkv"]["codec"]["d_c"],
                 d_ff=cfg["residualkv"]["codec"]["d_ff"])
    cfg["residualkv"]["codec"]["import"] = COMPRESSOR
    cfg["compare"] = {"tables": ["conduit/table1", "residualkv/tableIII"]}   # rules compare_table, compare_page
    cfg["beyond"]["conduit_rkv_cache"]["model"] = "ckpt-vlm"   # rules conduit_rkv_cache, rkv_mm_codec on the checkpoint
    return cfg, root


def _commands(out: str) -> dict[str, list[str]]:
    """{rule: printed shell commands} of a ``-n -p`` run."""
    cmds: dict[str, list[str]] = {}
    rule = None
    for line in out.splitlines():
        if m := re.match(r"(?:local)?rule (\w+):$", line):
            rule = m.group(1)
        elif line.startswith("Shell command: ") and line != "Shell command: None":
            cmds.setdefault(rule, []).append(line.removeprefix("Shell command: "))
    return cmds


def _rules_with_commands() -> set[str]:
    """Rules of workflow/rules/*.smk with a `shell:` (ambiguous_figure_alias never runs: its input raises;
    parity.smk's rules take no config value, and running their commands would build a virtual environment)."""
    names = set()
    for smk in (REPO / "workflow" / "rules").glob("*.smk"):
        if smk.name == "parity.smk":
            continue
        names |= {b.split(":", 1)[0] for b in re.split(r"^rule ", smk.read_text(), flags=re.M)[1:] if "\n    shell:" in b}
    return names - {"ambiguous_figure_alias"}


def test_hostile_paths_stay_one_argument_in_every_rule(tmp_path):
    cfg, root = _hostile_config(tmp_path)
    workdir = tmp_path / "work dir"
    workdir.mkdir()
    r = snakemake(workdir, "-n", "-p", *TARGETS, "--configfile", str(write_config(tmp_path / "hostile.yaml", cfg)))
    assert r.returncode == 0, r.stdout[-5000:]
    cmds = _commands(r.stdout)
    assert set(cmds) == _rules_with_commands()
    carrying = set()
    for rule, lines in cmds.items():
        for cmd in lines:
            argv = shlex.split(cmd)
            for arg in argv:
                if "pwned" in arg:
                    assert str(root) in arg, f"rule {rule}: hostile path split into {arg!r}:\n{cmd}"
                    carrying.add(rule)
            assert ";" not in argv and "#" not in argv, cmd
    # the hostile paths really went through the rules that read them
    assert {"eval", "conduit_cache", "table", "rkv_codec", "conduit_latency", "rkv_throughput",
            "rkv_codec_import", "scbench_convert"} <= carrying
    # and running each rule's command (kvbench and cp stubbed) runs nothing else
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    for rule, lines in cmds.items():
        subprocess.run(["bash", "-c", "kvbench() { :; }; cp() { :; }; " + lines[0]], cwd=scratch,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30)
    assert not list(scratch.rglob("pwned*")), f"a command executed a hostile value: {list(scratch.rglob('pwned*'))}"


@pytest.mark.parametrize("key, value, needle", [
    ("methods", ["reuse", "conduit; touch pwned #"], "config conduit_latency.methods: 'conduit; touch pwned #'"),
    ("device", "cuda; touch pwned", "config conduit_latency.device = 'cuda; touch pwned'"),
])
def test_bad_latency_values_fail_the_dry_run_before_any_job(tmp_path, key, value, needle):
    """Refused while the workflow is parsed (any target), naming the key; the previous CSV is still there."""
    cfg = load(CONFIG)
    cfg["conduit_latency"][key] = value
    old = tmp_path / "results" / "bench" / "smoke" / "conduit_latency.csv"
    old.parent.mkdir(parents=True)
    old.write_text("previous\n")
    r = snakemake(tmp_path, "-n", "results/conduit/table3.csv", "--configfile", str(write_config(tmp_path / "c.yaml", cfg)))
    assert r.returncode != 0 and needle in r.stdout, r.stdout[-3000:]
    assert "KeyError" not in r.stdout and old.read_text() == "previous\n"
    assert not list(tmp_path.rglob("pwned*"))


def test_variant_names_are_path_components(tmp_path):
    """Codec variant names become codecs/ and logs/ path components: the schema refuses shell syntax in them."""
    cfg = load(CONFIG)
    cfg["residualkv"]["variants"]["a;touch pwned"] = {"steps": 1}
    r = snakemake(tmp_path, "-n", "--configfile", str(write_config(tmp_path / "c.yaml", cfg)))
    assert r.returncode != 0 and "Error validating config file" in r.stdout and "a;touch pwned" in r.stdout, r.stdout[-3000:]


def test_latency_args_are_quoted():
    """A checkpoint path with a space is one argument of `kvbench bench conduit-latency` (it split before)."""
    cfg = load(REPO / "config" / "paper.yaml")
    job = latency_job(cfg, lambda m: f"/data/kv data;x/{m}", "zoo/tokenizer")
    argv = shlex.split(job.args)
    assert argv[argv.index("--model") + 1] == "/data/kv data;x/qwen2.5-vl-3b"
    assert argv[argv.index("--methods") + 1:argv.index("--repeats")] == TIMED_METHODS  # the section's default


def test_every_shell_field_is_quoted():
    """Each `{...}` in a rule's command is `:q`-quoted, except `{threads}` (an int), `{params.args}` (argument
    strings built with shlex.quote: RKVPlan.bench_args, latency_job, RKVPlan.codec_train_flags, common.smk's
    warm_start_args) and
    `{params.launch}` (RKVPlan.codec_launcher: `kvbench` or `torchrun ... --nproc_per_node N -m kvbench.cli`, N
    an int the schema checks; no config text)."""
    checked = 0
    for smk in sorted((REPO / "workflow" / "rules").glob("*.smk")):
        for block in re.split(r"^rule ", smk.read_text(), flags=re.M)[1:]:
            shell = re.search(r"\n    shell:\n((?:        .*\n?)+)", block)
            if not shell:
                continue
            text = "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', shell.group(1)))
            bare = [f for f in re.findall(r"\{([^{}]*)\}", text) if not f.endswith(":q") and f not in ("threads", "params.args", "params.launch")]
            assert not bare, f"{smk.name}: rule {block.split(':', 1)[0]} has unquoted {bare}"
            checked += 1
    assert checked >= 20
