"""CONDUIT's premise diagnostics (App. C-D, Tables 11-13): per visual token, what the scoring pass sees and
how stale the cached value really is.

For one assembled request (stale per-image caches under the serving prefix, :func:`kvbench.reuse.prepare`)
:func:`capture` runs the scoring pass (Stage I: α_l(t), the cached ‖V_l(t)‖) and the full prefill of the
same request (the fresh K/V a refresh would write), and returns one row per (layer, visual token):

- ``attn``: α_l(t), the query span's mean attention mass on the cached key (scoring pass, §3.3);
- ``vnorm_cached``, ``vnorm_fresh``: ‖V_l(t)‖₂ of the cached and of the fresh value (all KV heads);
- ``knorm_cached``: ‖K_l(t)‖₂ of the cached key (post-RoPE; RoPE rotates channel pairs, so the norm is the
  pre-RoPE key's);
- ``drift_sq``: ‖δ_l(t)‖² with δ = V_fresh − V_cached, the pre-output value drift between the cache-time and
  the serving prompt with the visual content fixed (the "two-query proxy" of §D.1);
- ``drift_mc``: the Monte Carlo estimate (1/M) Σ_m (u_m·δ)² with M Gaussian directions u_m ~ N(0, I) per
  token (§D.1: M = 5), unbiased for ‖δ‖² with variance O(1/M). The directions are drawn once per (record,
  layer, token) from ``seed`` and shared by every selection rule, so rules are compared on the same draws
  (paired).

The report (:mod:`kvbench.report.conduit.diagnostics`) builds Tables 11-13 from these rows. Our reading of the
summary's protocol (the paper text is not in this repository): the projected residual error of a refresh set
S at layer l is the diagonal form of §C.1, R_l(S) = Σ_{t ∉ S} α_l(t)² · ŝ_l(t), with ŝ the MC drift estimate;
docs/decisions/conduit.md, "Diagnostics, Tables 11-13", records the choices.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from kvbench.reuse.adapter import VLMAdapter
from kvbench.reuse.assemble import AssembledRequest
from kvbench.reuse.executor import full_prefill
from kvbench.reuse.scoring import scoring_pass

#: Columns of one capture row, in order.
COLUMNS = ("record", "layer", "token", "image", "attn", "vnorm_cached", "vnorm_fresh", "knorm_cached",
           "drift_sq", "drift_mc")


def _directions(seed: int, record: str, layer: int, n: int, m: int, d: int) -> torch.Tensor:
    """float32 ``[n, m, d]`` standard Gaussian directions, a pure function of (seed, record, layer)."""
    key = hashlib.sha256(f"{seed}:{record}:{layer}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") & (2**63 - 1))
    return torch.randn(n, m, d, generator=gen)


def _per_token(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``[1, n_kv, T, hd]`` -> float32 ``[N, n_kv·hd]`` rows at sequence indices ``index``."""
    return x[0][:, index].float().transpose(0, 1).reshape(len(index), -1)


@torch.no_grad()
def capture(adapter: VLMAdapter, req: AssembledRequest, record_id: str, *, m: int = 5, seed: int = 0,
            layers: Sequence[int] | None = None) -> list[dict]:
    """One request's diagnostic rows (module docstring), for ``layers`` (None: every decoder layer).

    Args:
        adapter: the model's reuse adapter.
        req: the assembled request (stale caches under its serving prefix).
        record_id: the record's id (names the rows and seeds the directions).
        m: Monte Carlo directions per token (§D.1: 5); >= 1.
        seed: direction seed.
        layers: decoder layer indices.

    Returns:
        ``len(layers) · N_visual`` dicts with the keys of :data:`COLUMNS` (floats; ``token`` is the visual
        token's number 0..N_visual-1 in prompt order, ``image`` its image 0..K-1).

    Raises:
        ValueError: ``m`` < 1, a layer outside 0..L-1, or a request with nothing after its last image.
    """
    if not isinstance(m, int) or m < 1:
        raise ValueError(f"m (Monte Carlo directions per token) must be an integer >= 1, got {m!r}")
    L = adapter.n_layers
    layers = list(range(L)) if layers is None else [int(x) for x in layers]
    if not layers or any(not 0 <= x < L for x in layers):
        raise ValueError(f"layers must be indices in 0..{L - 1}, got {layers}")
    sp = scoring_pass(adapter, req)
    fresh = full_prefill(adapter, req)
    vis = req.visual_index
    rows = []
    for layer in layers:
        v_c = _per_token(req.stale_v[layer], vis)
        v_f = _per_token(fresh.values[layer], vis)
        k_c = _per_token(req.stale_k[layer], vis)
        delta = v_f - v_c
        u = _directions(seed, record_id, layer, len(vis), m, delta.shape[1])
        mc = (torch.einsum("nmd,nd->nm", u, delta) ** 2).mean(dim=1)
        cols = {"attn": sp.attn[layer], "vnorm_cached": v_c.norm(dim=-1), "vnorm_fresh": v_f.norm(dim=-1),
                "knorm_cached": k_c.norm(dim=-1), "drift_sq": (delta ** 2).sum(dim=-1), "drift_mc": mc}
        cols = {k: v.tolist() for k, v in cols.items()}
        images = req.image_of_visual.tolist()
        for t in range(len(vis)):
            rows.append({"record": record_id, "layer": layer, "token": t, "image": images[t],
                         **{k: cols[k][t] for k in cols}})
    return rows
