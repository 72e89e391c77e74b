"""Short content hashes of recipes: trained artefacts are keyed by what determines them.

A zoo model, a tokenizer, a smoke split or a codec lives in a directory named by
its profile and by :func:`recipe_hash` of everything that determines its bytes
(``zoo/<profile>/<model>-<hash>/``), so changing a config writes a new
directory instead of deleting a finished one, and switching back costs nothing.
Wall-clock settings (slices, scheduler runtimes) are never part of a recipe.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any


def recipe_hash(recipe: Any, length: int = 8) -> str:
    """First ``length`` hex digits of the SHA-256 of ``recipe`` as canonical JSON (sorted keys).

    Raises:
        TypeError: ``recipe`` holds a value JSON cannot encode.
    """
    text = json.dumps(recipe, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:length]
