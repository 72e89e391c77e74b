"""Experiments beyond both papers, built from both sides' machinery.

- :mod:`kvbench.beyond.compressed_store`: CONDUIT's per-image KV caches (:mod:`kvbench.reuse`) stored in
  ResidualKV's form (:mod:`kvbench.compress.residualkv`) and restored when a request reuses the image
  (docs/decisions/conduit.md, "CONDUIT over ResidualKV-compressed image caches").

A package of its own so that neither paper's engine imports the other: this package may import ``reuse`` and
``compress``; the evaluation (:mod:`kvbench.eval.refresh`) and the reports import it.
"""
