"""What the class docstring of a registered method (refresh policy, press) must hold: the source it implements and a
``Parameters`` section (tests/test_reuse_policies.py, tests/test_press_matrix.py)."""
from __future__ import annotations

import re

#: A source: an arXiv id or link, or an "Author et al., VENUE year" citation.
SOURCE = re.compile(r"arXiv:? ?\d{4}\.\d{4,5}|arxiv\.org/abs/\d{4}\.\d{4,5}|\bet al\.,? [A-Z]{3,5} \d{4}")
PARAMETERS = re.compile(r"^\s*Parameters\b", re.M)


def parameters_section(cls: type) -> str:
    """The text after ``Parameters`` in ``cls``'s own docstring; fails naming what is missing. Its own: ``@dataclass``
    writes ``Name(field, ...)`` where a class has none, and a subclass must not pass on its base's."""
    doc = cls.__dict__.get("__doc__") or ""
    assert SOURCE.search(doc), f"{cls.__name__}'s docstring names no source (arXiv id or link, or 'X et al., VENUE year')"
    found = PARAMETERS.search(doc)
    assert found, f"{cls.__name__}'s docstring has no Parameters section"
    return doc[found.end():]
