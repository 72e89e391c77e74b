"""The user-facing docs say only true things: README has no session history, docs/workflow.md's targets resolve,
and every citation of a decision or a measurement names a file and heading that exist."""
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


# --- citations ---------------------------------------------------------------------------------------------------

#: Where citations may stand: the package, tests, workflow, configs, scripts, docs and the repository's top files.
CITING = ("src", "tests", "workflow", "config", "scripts", "docs", "profiles", "envs")
CITING_FILES = ("README.md", "Snakefile", "pyproject.toml")
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".smk", ".sh", ".rst", ".toml", ".txt", ".cfg", ""}
#: A line break inside a comment or docstring, with the continuation's comment marker (``#``, ``#:``).
WRAP = re.compile(r"\s*\n[ \t]*(?:#:?[ \t]*)?")
#: ``docs/<file>.md`` (in backticks or not), optionally followed by ``, "<heading>"``.
CITATION = re.compile(r'docs/((?:decisions/)?[\w.-]+\.md)`*(?:,\s*"([^"\n]+)")?')
#: Citations of files that are not in the repository any more (built so this file does not cite them itself).
GONE = ("docs/decisions" + ".md", "notes" + " §")


def citing_texts(root=REPO) -> dict[str, str]:
    """``{relative path: text}`` of every text file that may cite the docs, line breaks inside comments joined."""
    paths = [root / f for f in CITING_FILES]
    for d in CITING:
        paths += [p for p in (root / d).rglob("*") if p.is_file() and "__pycache__" not in p.parts
                  and not any(part.endswith(".egg-info") for part in p.parts)]  # pip's build metadata, not ours
    out = {}
    for p in paths:
        if p.suffix not in TEXT_SUFFIXES or not p.exists():
            continue
        try:
            text = p.read_text()
        except UnicodeDecodeError:
            continue
        out[str(p.relative_to(root))] = WRAP.sub(" ", text)
    return out


def headings(path) -> set[str]:
    """The Markdown headings of a file, without their ``#`` marks."""
    return {m.group(1).strip() for m in re.finditer(r"^#{1,6} (.+)$", path.read_text(), flags=re.M)}


def broken_citations(root=REPO) -> list[str]:
    """Every ``docs/<file>.md[, "<heading>"]`` citation whose file or heading does not exist, and every citation
    of a file that is not in the repository (:data:`GONE`), as ``path: citation (why)``."""
    bad = []
    for rel, text in sorted(citing_texts(root).items()):
        for gone in GONE:
            if gone in text:
                bad.append(f"{rel}: {gone!r} (not in the repository; cite docs/decisions/<file>.md or the paper's section)")
        for m in CITATION.finditer(text):
            doc, heading = root / "docs" / m.group(1), m.group(2)
            if "docs/" + m.group(1) in GONE:
                continue  # reported above
            if not doc.is_file():
                bad.append(f"{rel}: {m.group(0)} (no such file)")
            elif heading is not None and not any(h == heading or h.startswith(heading + " (") for h in headings(doc)):
                bad.append(f"{rel}: {m.group(0)} (no such heading in {doc.relative_to(root)})")
    return bad


def test_every_docs_citation_names_an_existing_file_and_heading():
    """A decision is cited by its file under docs/decisions/ and its heading in quotes, a measurement by docs/log.md and
    its heading; both must exist, anywhere in the repository, and nothing cites the retired single decisions file or
    notes that are not in the repository."""
    assert broken_citations() == []


def test_broken_citations_are_found(tmp_path):
    """The check can fail: a missing heading, a missing file, a wrapped citation and the retired files are caught."""
    docs = "docs" + "/"  # so that this file's own citations of fake headings are not citations
    for d in ("docs/decisions", "src"):
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "docs" / "decisions" / "zoo.md").write_text("# Zoo\n\n## Skill floors\ntext\n")
    (tmp_path / "docs" / "log.md").write_text("# Log\n\n## 2026-12-01 A trial\n")
    (tmp_path / "README.md").write_text(f'Floors: {docs}decisions/zoo.md, "Skill floors"; {docs}log.md, "2026-12-01 A trial".\n')
    assert broken_citations(tmp_path) == []
    (tmp_path / "src" / "a.py").write_text(
        f'# see {docs}decisions/zoo.md, "Skil floors" and `{docs}decisions/reuse.md`, "Policies"\n'
        f'"""Wrapped ({docs}decisions/zoo.md,\n    "Training status")."""\n'
        f'# {GONE[0]}, "Workflow"; {GONE[1]}3.3\n')
    bad = broken_citations(tmp_path)
    assert len(bad) == 5, bad
    assert [b for b in bad if "Skil floors" in b and "no such heading" in b]
    assert [b for b in bad if "reuse.md" in b and "no such file" in b]
    assert [b for b in bad if "Training status" in b]
    assert [b for b in bad if GONE[0] in b] and [b for b in bad if GONE[1] in b]
