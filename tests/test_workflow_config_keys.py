"""A schema-valid config never ends in a KeyError (issue #11, item 7).

Every optional key of workflow/schemas/config.schema.yaml is walked from the schema itself (so a new key
needs a decision here):

- a key with a schema default comes back when it is dropped (``snakemake.utils.validate`` fills defaults,
  nested ones included), so the code may index it;
- a key without a default is dropped from a config that has it, and the dry run of the targets that read it
  must succeed or fail with a message naming the key, never with a KeyError.

The zoo/checkpoint and smoke/jsonl alternatives of a model or dataset are required one-of pairs, not optional
keys. Dry runs go through Snakemake's Python API in this process (the package imports once, each DAG then
takes about a second).
"""
from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import yaml
from snakemake.utils import validate

from test_workflow import CONFIG, PAPER_CONFIG, REPO, SNAKEFILE, _fake_paper_root, load

SCHEMA = REPO / "workflow" / "schemas" / "config.schema.yaml"


def _optional_keys(node: dict, defs: dict, path: tuple = ()):
    """``(path, has_default)`` of every optional key under ``node``; ``*`` stands for each entry of a map."""
    if "$ref" in node:
        node = defs[node["$ref"].rsplit("/", 1)[1]]
    required = set(node.get("required", [])) | {k for alt in node.get("oneOf", []) for k in alt.get("required", [])}
    for key, sub in node.get("properties", {}).items():
        if key not in required:
            yield path + (key,), "default" in sub
        yield from _optional_keys(sub, defs, path + (key,))
    if isinstance(node.get("additionalProperties"), dict):
        yield from _optional_keys(node["additionalProperties"], defs, path + ("*",))


SCHEMA_DOC = yaml.safe_load(SCHEMA.read_text())
OPTIONAL = dict(_optional_keys(SCHEMA_DOC, SCHEMA_DOC["$defs"]))
DEFAULTED = sorted(".".join(p) for p, has in OPTIONAL.items() if has)

# Optional keys without a default: (base config, targets that read the key, expected failure or None).
NOT_DEFAULTED = {
    "conduit": ("smoke", ["conduit"], "no `conduit:` section"),
    "conduit.multi_image.*.k": ("smoke", ["conduit"], None),
    "conduit.single_image.*.k": ("smoke", ["conduit"], None),
    "conduit_latency": ("smoke", ["results/conduit/table3.csv"], "no `conduit_latency:` section"),
    # absent: every Table 3 method (kvbench.bench.TABLE3_METHODS, the one list; latency_job fills it in)
    "conduit_latency.methods": ("smoke", ["results/conduit/table3.csv"], None),
    "conduit_diagnostics": ("smoke", ["results/conduit/table11.csv"], "no `conduit_diagnostics:` section"),
    "residualkv": ("smoke", ["residualkv"], "no `residualkv:` section"),
    "residualkv.variants": ("smoke", ["residualkv"], "residualkv.variants does not configure"),
    **{f"residualkv.variants.*.{k}": ("smoke", ["residualkv"], None)
       for k in ("overrides", "objective", "steps", "seq_len", "slice_s", "lr", "data")},
    # the `residualkv` aggregate builds the tables the config has; asked for by name, a table without rows fails
    "residualkv.tableVII": ("smoke", ["results/residualkv/tableVII.csv"], "residualkv.tableVII is not set"),
    "residualkv.tableVIII": ("smoke", ["results/residualkv/tableVIII.csv"], "residualkv.tableVIII is not set"),
    # the tables beyond the paper (issue #32): asked for by name without their rows they fail naming the key
    "residualkv.table_full_layer_form": ("smoke", ["results/residualkv/table_full_layer_form.csv"],
                                         "residualkv.table_full_layer_form is not set"),
    "residualkv.table_layer_flow": ("smoke", ["results/residualkv/table_layer_flow.csv"],
                                    "residualkv.table_layer_flow is not set"),
    "residualkv.stride_sweep": ("smoke", ["residualkv"], "residualkv.stride_sweep is not set"),
    "residualkv.tableIV": ("smoke", ["results/residualkv/tableIV.csv"], "residualkv.tableIV is not set"),
    # absent: Table IV's columns are `tasks` (single-query records answered the same way, one query each)
    "residualkv.target_tasks": ("smoke", ["residualkv"], None),
    # absent: the file is read as kvbench records (no conversion)
    "datasets.*.scbench": ("paper", ["all"], None),
    # Table V (long generation) runs on long_generation's backbone; its other keys fall back to the section's
    "residualkv.tableV": ("smoke", ["results/residualkv/tableV.csv"], "residualkv.tableV is not set"),
    # (both profiles have both)
    "residualkv.long_generation": ("paper", ["residualkv"], "residualkv.long_generation"),
    **{f"residualkv.long_generation.{k}": ("paper", ["results/residualkv/tableV.csv"], None)
       for k in ("codec", "n_test", "protocol", "threads", "train", "sampling", "sampling.temperature",
                 "sampling.top_k", "sampling.top_p")},
    # absent: the key of residualkv.train (merged under long_generation.train)
    **{f"residualkv.long_generation.train.{k}": ("smoke", ["results/residualkv/tableV.csv"], None)
       for k in ("threads", "objective", "steps", "seq_len", "slice_s", "lr", "data", "dtype", "batch", "data_files",
                 "text_field", "device", "gpus", "checkpointing")},
    "residualkv.stride_sweep.stride": ("smoke", ["residualkv"], None),
    # Fig. 3 (observations): model and tasks default to residualkv.model / tasks
    **{k: ("smoke", ["figures/residualkv/fig3.pdf"], None)
       for k in ("residualkv.fig3", "residualkv.fig3.model", "residualkv.fig3.tasks")},
    # Fig. 13 (visual case): asked for by name without its section it fails naming it; model and task default to
    # residualkv.tableII's first
    "residualkv.fig13": ("smoke", ["figures/residualkv/fig13.pdf"], "residualkv.fig13 is not set"),
    **{k: ("smoke", ["figures/residualkv/fig13.pdf"], None) for k in ("residualkv.fig13.model", "residualkv.fig13.task")},
    # Table II (multimodal): asked for by name without its section it fails naming it; its ResidualKV rows need the codec
    "residualkv.tableII": ("smoke", ["results/residualkv/tableII.csv"], "residualkv.tableII"),
    "residualkv.tableII.codec": ("smoke", ["results/residualkv/tableII.csv"], "residualkv.tableII.codec"),
    # codec-training recipe keys without defaults, so that older recipes keep their hashes (issue #16 item 1)
    **{f"residualkv.train.{k}": ("smoke", ["residualkv"], None) for k in ("dtype", "batch", "data_files", "text_field")},
    # absent: the main codec is trained (tests/test_rkv_deltakv_format.py dry-runs a config that imports it)
    "residualkv.codec.import": ("smoke", ["residualkv"], None),
    "models.*.gpus": ("paper", ["all"], None),
    "models.*.mem_mb": ("paper", ["all"], None),
    "models.*.codec": ("paper", ["all", "residualkv"], None),
    "datasets.*.kind": ("smoke", ["all", "conduit", "residualkv"], None),
    # beyond both papers: asked for by name without its mapping, the compressed-image-cache table fails naming it
    "beyond": ("smoke", ["results/beyond/conduit_rkv_cache.csv"], "no `beyond:` section"),
    "beyond.conduit_rkv_cache": ("smoke", ["results/beyond/conduit_rkv_cache.csv"], "beyond.conduit_rkv_cache"),
}


def test_every_optional_key_is_decided():
    assert sorted(".".join(p) for p, has in OPTIONAL.items() if not has) == sorted(NOT_DEFAULTED)
    assert len(DEFAULTED) > 30  # the walk reached nested and $ref'd objects


def _drop(cfg: dict, path: str) -> int:
    """Remove ``path`` (``*``: from every entry) from ``cfg`` in place, where present; the number removed."""
    head, _, rest = path.partition(".")
    if head == "*":
        return sum(_drop(v, rest) for v in cfg.values() if isinstance(v, dict))
    if not rest:
        return int(cfg.pop(head, None) is not None)
    return _drop(cfg[head], rest) if isinstance(cfg.get(head), dict) else 0


def _get_all(cfg, path: str) -> list:
    head, _, rest = path.partition(".")
    values = list(cfg.values()) if head == "*" else ([cfg[head]] if head in cfg else [])
    return values if not rest else [x for v in values if isinstance(v, dict) for x in _get_all(v, rest)]


#: Targets that read a top-level section's keys.
SECTION_TARGETS = {"conduit": ["conduit"], "conduit_latency": ["results/conduit/table3.csv"],
                   "conduit_diagnostics": ["conduit"],
                   "residualkv": ["residualkv"], "beyond": ["results/beyond/conduit_rkv_cache.csv"]}


@pytest.mark.parametrize("path", DEFAULTED)
def test_a_dropped_key_with_a_default_comes_back(tmp_path, path):
    """The key is filled in again, and the dry run of the targets that read it works with the default."""
    cfg = load(CONFIG)
    _drop(cfg, path)
    configfile = tmp_path / "c.yaml"
    configfile.write_text(yaml.safe_dump(cfg))
    validate(cfg, str(SCHEMA))
    parents = _get_all(cfg, path.rsplit(".", 1)[0]) if "." in path else [cfg]
    assert len(_get_all(cfg, path)) == len(parents) >= 1
    (tmp_path / "work").mkdir()
    _dry_run(configfile, SECTION_TARGETS.get(path.split(".")[0], ["all"]), tmp_path / "work")


def _paper_config(root: Path) -> dict:
    _fake_paper_root(root)
    cfg = load(PAPER_CONFIG)
    cfg["paths"] = {"root": str(root)}
    return cfg


def _dry_run(configfile: Path, targets: list[str], workdir: Path) -> None:
    """Build the DAG of ``targets`` as ``snakemake -n -p`` would, in this process; raises what Snakemake raises."""
    from snakemake.api import SnakemakeApi
    from snakemake.settings.types import ConfigSettings, DAGSettings, OutputSettings, Quietness, ResourceSettings

    path = os.environ["PATH"]  # the Snakefile puts the interpreter's bin/ first
    try:
        with SnakemakeApi(OutputSettings(dryrun=True, printshellcmds=True, quiet={Quietness.ALL})) as api:
            wf = api.workflow(resource_settings=ResourceSettings(), config_settings=ConfigSettings(configfiles=[configfile]),
                              snakefile=SNAKEFILE, workdir=workdir)
            wf.dag(DAGSettings(targets=set(targets))).execute_workflow(executor="dryrun")
    finally:
        os.environ["PATH"] = path


def _chain(e: BaseException) -> str:
    """Types and messages of an exception and its explicit causes (``raise ... from``; Snakemake's own
    handled lookups in ``__context__`` are not the config's failure)."""
    out = []
    while e is not None and len(out) < 10:
        out.append(f"{type(e).__name__}: {e}")
        e = e.__cause__
    return "\n".join(out)


@pytest.mark.parametrize("path", sorted(NOT_DEFAULTED))
def test_a_dropped_key_without_a_default_is_named_or_not_needed(tmp_path, path):
    base, targets, needle = NOT_DEFAULTED[path]
    cfg = load(CONFIG) if base == "smoke" else _paper_config(tmp_path / "kvbench-data")
    _drop(cfg, path)  # a config without the key: where the base config lacks it too, the base config itself
    configfile = tmp_path / "c.yaml"
    configfile.write_text(yaml.safe_dump(cfg))
    workdir = tmp_path / "work"
    workdir.mkdir()
    try:
        _dry_run(configfile, targets, workdir)
    except Exception as e:  # noqa: BLE001 - judged below
        failure = _chain(e)
        assert "KeyError" not in failure, failure
        assert needle is not None and needle in failure, failure
    else:
        assert needle is None, f"dry run without {path} succeeded; expected it to fail naming {needle!r}"


def test_codec_training_length_is_required(tmp_path):
    """`residualkv.train` without `steps` (training is counted in steps) fails validation."""
    cfg = copy.deepcopy(load(CONFIG))
    del cfg["residualkv"]["train"]["steps"]
    with pytest.raises(Exception, match="'steps' is a required property"):
        validate(cfg, str(SCHEMA))


def test_a_figure_names_the_codec_variants_it_misses(tmp_path):
    """Figs. 10-12 read fixed variants (base, separate, ...): without them the dry run names
    residualkv.variants (it ended in KeyError: 'base')."""
    cfg = load(CONFIG)
    del cfg["residualkv"]["variants"], cfg["residualkv"]["tableVIII"]  # Table VIII's rows name a variant too
    configfile = tmp_path / "c.yaml"
    configfile.write_text(yaml.safe_dump(cfg))
    (tmp_path / "work").mkdir()
    _dry_run(configfile, ["results/residualkv/tableIII.csv"], tmp_path / "work")  # tables need no variant
    with pytest.raises(Exception) as e:
        _dry_run(configfile, ["figures/residualkv/fig10.pdf"], tmp_path / "work")
    failure = _chain(e.value)
    assert "KeyError" not in failure and "codec variant 'base' is not configured under residualkv.variants" in failure, failure
