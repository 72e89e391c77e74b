"""`snakemake --report`: every table and figure is marked for the report, and the report lists what is built.

The workflow's rules are read through the Snakemake API in a subprocess (it changes the working
directory); the reports run ``python -m snakemake --report`` on placeholder files in a temporary
directory, so no test writes into the repository or runs a job.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from fnmatch import fnmatch
from pathlib import Path
from types import SimpleNamespace

import jinja2
import pytest
import yaml

from test_workflow import CONFIG, SNAKEFILE, snakemake

CATEGORIES = {"CONDUIT", "ResidualKV", "Beyond both papers", "Smoke suite", "Parity", "Published comparison"}
SUBCATEGORIES = {"Tables", "Figures", "Figure data", "Published comparison", "Summary"}
# Outputs under results/ that are not tables or figures, and copies under short names: not reported.
NOT_REPORTED = {
    "results/runs/*": "per-run metrics and predictions",
    "results/bench/*": "raw per-repeat timings, summarised by CONDUIT Table 3",
    "results/conduit/diag/*": "per-token diagnostic captures, summarised by CONDUIT Tables 11-13",
    "results/*/zoo.timing.csv": "training wall-clock beside the zoo table (differs between runs by design)",
}
SHORT_NAMES = "targets.smk"  # results/table<N>.csv, figures/fig<N>.pdf: copies of the canonical targets
# The tables and figures issue #11 names (smoke profile); a report item list that drops one fails.
EXPECTED = (
    ["results/smoke/zoo.csv", "figures/smoke/zoo_training.pdf"]
    + [f"results/conduit/table{n}.csv" for n in range(1, 6)]
    + ["results/conduit/staleness_gap.csv", "figures/conduit/fig3.pdf", "results/conduit/fig3.csv"]
    + [f"results/residualkv/table{n}.csv" for n in ("III", "VI", "VII", "VIII")]
    + [f"{d}/residualkv/fig{n}.{ext}" for n in (5, 6, 8, 10, 11, 12) for d, ext in (("figures", "pdf"), ("results", "csv"))]
    + ["results/conduit/table1.compare.csv", "results/residualkv/tableIII.compare.csv", "results/compare.md"]
)

_INTROSPECT = r"""
import json, sys
from pathlib import Path
from types import SimpleNamespace
from snakemake.api import SnakemakeApi
from snakemake.io import get_flag_value, is_flagged
from snakemake.settings.types import ResourceSettings

def value(x, wildcards):
    # category and params may be functions of the wildcards (the one `table` rule names its table's paper)
    return x(SimpleNamespace(**wildcards)) if callable(x) else x

snakefile, workdir = Path(sys.argv[1]), Path(sys.argv[2])
with SnakemakeApi() as api:
    wf = api.workflow(resource_settings=ResourceSettings(), snakefile=snakefile, workdir=workdir)._workflow
    outputs = []
    for rule in wf.rules:
        for o in rule.output:
            rep = get_flag_value(o, "report") if is_flagged(o, "report") else None
            outputs.append({"rule": rule.name, "smk": Path(rule.snakefile).name, "pattern": str(o), "report": rep and {
                "caption": rep.caption and rep.caption.get_path_or_uri(secret_free=True),
                "category": "<per file>" if callable(rep.category) else rep.category,
                "subcategory": rep.subcategory}})
    items = wf.globals["report_items"]()
    producers = {}
    for item in items:
        for f in item:
            producers[f] = []
            for r in wf.rules:
                for o in r.output:
                    if (m := o.match(f)):
                        rep = get_flag_value(o, "report") if is_flagged(o, "report") else None
                        wc = m.groupdict()
                        caption = getattr(r.params, "caption", None)
                        producers[f].append({"pattern": str(o), "wildcards": wc, "rule": r.name,
                                             "category": rep and value(rep.category, wc),
                                             "params": {"caption": value(caption, wc)} if caption else {}})
    print("JSON " + json.dumps({"outputs": outputs, "items": items, "producers": producers}))
"""


@pytest.fixture(scope="module")
def workflow(tmp_path_factory) -> dict:
    """Every rule output (pattern, report flag), the Snakefile's report_items() and each item file's producer."""
    out = subprocess.run([sys.executable, "-c", _INTROSPECT, str(SNAKEFILE), str(tmp_path_factory.mktemp("wf"))],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:]
    return json.loads(next(line[5:] for line in out.stdout.splitlines() if line.startswith("JSON ")))


def _is_table_or_figure(o: dict) -> bool:
    p = o["pattern"]
    if o["smk"] == SHORT_NAMES or any(fnmatch(p, g) for g in NOT_REPORTED):
        return False
    return (p.startswith("results/") and p.endswith(".csv")) or (p.startswith("figures/") and p.endswith(".pdf"))


def test_every_table_and_figure_output_is_marked_for_the_report(workflow):
    checked = [o for o in workflow["outputs"] if _is_table_or_figure(o)]
    assert len(checked) >= 13, [o["pattern"] for o in checked]  # every table of both papers is one pattern
    for o in checked:
        rep = o["report"]
        assert rep is not None, f"rule {o['rule']}: {o['pattern']} is not wrapped in report()"
        assert rep["caption"] and Path(rep["caption"]).is_file(), f"rule {o['rule']}: caption {rep['caption']!r} missing"
        assert Path(rep["caption"]).resolve().parent == SNAKEFILE.parent / "workflow" / "report"
        assert rep["category"] in CATEGORIES | {"<per file>"} and rep["subcategory"] in SUBCATEGORIES, (o["rule"], rep)
    # a category that is a function of the wildcards gives a known one for every file it reports
    for f, producers in workflow["producers"].items():
        for p in producers:
            assert p["category"] is None or p["category"] in CATEGORIES, (f, p)
    # the exclusions still name real outputs (a renamed directory would silently widen them)
    for glob in NOT_REPORTED:
        assert any(fnmatch(o["pattern"], glob) for o in workflow["outputs"]), glob


def test_report_items_cover_every_marked_output(workflow):
    """Each report-marked output is an item of report_items() (what `all` asks for under --report), and
    every table and figure issue #11 names is one."""
    files = {f for item in workflow["items"] for f in item}
    assert set(EXPECTED) <= files, sorted(set(EXPECTED) - files)
    produced = {p["pattern"] for f in files for p in workflow["producers"][f]}
    for o in workflow["outputs"]:
        if o["report"] is not None:
            assert o["pattern"] in produced, f"rule {o['rule']}: {o['pattern']} is marked but not in report_items()"
    for f in files:
        assert len(workflow["producers"][f]) >= 1, f"{f}: no rule writes it"


def _item_name(path: str) -> str:
    """How a caption names the table or figure at ``path``."""
    stem = Path(path).stem.removesuffix(".compare")  # a table's comparison with the published figures names it
    if stem == "compare":
        return "Ours beside the published figures"
    beyond = {"table_full_layer_form": "full-layer form", "table_layer_flow": "Where the task flows"}
    if stem in beyond:   # ResidualKV tables beyond the paper (issue #32)
        return beyond[stem]
    if m := re.fullmatch(r"table(\w+)", stem):
        return f"Table {m.group(1)}"
    if m := re.fullmatch(r"fig(\d+)(_throughput|_summary)?", stem):
        return f"Figure {m.group(1)}" if "/conduit/" in path else f"Fig. {m.group(1)}"
    return {"staleness_gap": "staleness gap", "zoo": "zoo", "zoo_training": "zoo", "kvpress": "Parity with kvpress",
            "conduit_rkv_cache": "compressed image caches"}[stem]


def test_each_caption_names_its_table_or_figure_and_paper_section(workflow):
    """Captions are Jinja templates (Snakemake renders them with `snakemake.wildcards` and `.config`): one per
    file, naming the table or figure, the paper section (or that it has none) and, off the paper, that the
    numbers are not the paper's."""
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
    config = yaml.safe_load(CONFIG.read_text())
    captions = {o["pattern"]: o["report"]["caption"] for o in workflow["outputs"] if o["report"]}
    for f in {f for item in workflow["items"] for f in item}:
        (producer,) = [p for p in workflow["producers"][f] if p["pattern"] in captions]
        snakemake_obj = SimpleNamespace(wildcards=SimpleNamespace(**producer["wildcards"]), config=config,
                                        params=SimpleNamespace(**producer["params"]))
        text = " ".join(env.from_string(Path(captions[producer["pattern"]]).read_text())
                        .render(snakemake=snakemake_obj).split())
        assert _item_name(f) in text, (f, text)
        assert "§" in text or "no paper section" in text, (f, text)
        assert "Profile: ``smoke``" in text, (f, text)
        if "zoo" not in f:
            assert "not the paper's numbers" in text, (f, text)


def _reported(workdir: Path) -> dict[str, tuple[str, str]]:
    """Run `snakemake --report report.html` in ``workdir``: {path: (category, subcategory)} of its results."""
    r = snakemake(workdir, "--report", "report.html")
    assert r.returncode == 0, r.stdout[-3000:]
    html = (workdir / "report.html").read_text()
    cats = json.loads(re.search(r"^\s*var categories = (\{.*\});$", html, flags=re.M).group(1))
    return {path: (cat, sub) for cat, subs in cats.items() for sub, paths in subs.items() for path in paths}


def test_report_before_anything_is_built(tmp_path):
    assert _reported(tmp_path) == {}
    assert not (tmp_path / "results").exists() and not (tmp_path / "figures").exists()


def test_report_lists_every_built_table_and_figure(tmp_path, workflow):
    """Placeholders for every item but a few; a figure whose CSV (or Fig. 11's throughput CSV) is missing
    is left out instead of failing the report, and nothing else is."""
    missing = {"results/residualkv/fig5.csv", "results/residualkv/fig11_throughput.csv", "figures/smoke/zoo_training.pdf"}
    files = {f for item in workflow["items"] for f in item} - missing
    for f in files:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_bytes(b"%PDF-1.4\n%%EOF\n" if f.endswith(".pdf") else b"# placeholder\na,b\n1,2\n")
    expected = {f for item in workflow["items"] if not set(item) & missing for f in item}
    assert "figures/residualkv/fig5.pdf" not in expected and "figures/residualkv/fig11.pdf" not in expected
    reported = _reported(tmp_path)
    assert set(reported) == expected
    produced = {o["pattern"]: o["report"] for o in workflow["outputs"] if o["report"]}
    for f, (cat, sub) in reported.items():
        (p,) = [p for p in workflow["producers"][f] if p["pattern"] in produced]
        assert (cat, sub) == (p["category"], produced[p["pattern"]]["subcategory"]), f
    assert reported["results/conduit/table1.csv"] == ("CONDUIT", "Tables")
    assert reported["figures/residualkv/fig8.pdf"] == ("ResidualKV", "Figures")
    assert reported["results/smoke/zoo.csv"] == ("Smoke suite", "Tables")
