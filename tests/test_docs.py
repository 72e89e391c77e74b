"""The user-facing docs say only true things: README has no session history, docs/workflow.md's targets resolve."""
from __future__ import annotations

import itertools
import re

from test_workflow import REPO, snakemake

WORKFLOW_DOC = REPO / "docs" / "workflow.md"


def _expand(target: str) -> list[str]:
    """``a/table{1,2}.csv`` -> ``[a/table1.csv, a/table2.csv]`` (shell-style braces, any number)."""
    parts = re.split(r"\{([^{}]*)\}", target)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def documented_targets() -> list[str]:
    """Concrete file targets named in the first column of docs/workflow.md's Targets table."""
    section = WORKFLOW_DOC.read_text().split("## Targets", 1)[1].split("\n## ", 1)[0]
    out = []
    for row in section.splitlines():
        if not row.startswith("| `"):
            continue
        for name in re.findall(r"`([^`]+)`", row.split("|")[1]):
            if "<" in name or not name.startswith(("results/", "figures/")):
                continue  # placeholders (<profile>, <hash>) and rule names
            out += _expand(name)
    return out


def test_documented_short_and_canonical_targets_resolve(tmp_path):
    targets = [t for t in documented_targets() if t not in ("figures/fig3.pdf", "figures/fig4.pdf")]
    assert "figures/fig8.pdf" in targets and "results/tableVIII.csv" in targets and "results/table5.csv" in targets
    r = snakemake(tmp_path, "-n", *targets)
    assert r.returncode == 0, r.stdout[-3000:]


def test_documented_ambiguous_figures_fail(tmp_path):
    assert {"figures/fig3.pdf", "figures/fig4.pdf"} <= set(documented_targets())
    assert snakemake(tmp_path, "-n", "figures/fig3.pdf").returncode != 0


def test_readme_speaks_of_the_project_only():
    readme = (REPO / "README.md").read_text()
    assert not re.search(r"\bsession\b|closing note|issue #\d", readme, flags=re.I), "README mentions work history"
    assert "--budget-s" not in readme and "zoo/.train" not in readme  # flags and paths that no longer exist
