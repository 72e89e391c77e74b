"""PACT: at layer L, prune unimportant visual tokens (EUTI), cluster the rest (DBDPC), merge each cluster to one.

Dhouib et al., "PACT: Pruning and Clustering-Based Token Reduction for Faster Visual Language Models",
CVPR 2025; original repo ``orailix/PACT``. What its code does at commit 34ca136 (``Qwen2Model.forward`` in
``transformers/models/qwen2/modeling_qwen2.py``, the LLaVA-OneVision path; ``get_key_query_value`` there;
``DBDPC.fit_variant``, ``token_reduction``, ``merge_clusters`` in ``transformers/PACT/utils_pruning.py``;
defaults in ``configs/pact.json`` and ``scripts/pact_llava-onevision7b.sh``), before decoder layer ``L``
(``layer_for_reduction`` 4), with ``h`` that layer's input hidden states:

- **EUTI pruning** (``token_pruning``): queries and keys of layer ``L`` from ``input_layernorm(h)``, before RoPE
  (``use_cosine_in_token_pruning`` false); one global query per head, the mean of the queries of the
  non-text tokens (every token up to the last visual one); its softmax attention (scale ``1/sqrt(D)``) over the
  keys of those tokens, averaged over heads, at the visual tokens, times the L2 norm of each visual token's
  ``h`` (``multiply_by_norm``); the top ``int(n_vis · 0.55)`` are kept (``pruning_tokeep_percentage_value``;
  ties to the lowest index);
- **DBDPC clustering** of the kept tokens on layer ``L``'s keys after RoPE, all KV heads flattened
  (``current_k_cosine``), cosine distance ``d = max(0, 1 − cos)``: density ``rho_i = Σ_j exp(−(d_ij/dc)²)``
  (``dc`` 2) replaced by its rank; rounds over the unassigned points: ``delta_i`` = distance to the nearest
  unassigned point at least as dense (the densest: +inf); points with ``delta > cutoff`` (0.21) become centres
  and every unassigned point within ``cutoff`` of one is assigned; once a round finds fewer than 10 centres,
  the rest are visited by decreasing density, each becoming a centre unless within ``cutoff`` of one already;
- every kept token joins its nearest centre; a pruned visual token joins its nearest centre if within
  ``coef_pruned · cutoff`` (1.5), else is dropped (``include_pruned_in_mean``);
- each cluster's hidden state becomes the mean of its members (``take_mean``), carried by the centre token at
  the centre's position id (``get_mean_position_id`` false); the other members leave the sequence, and layers
  ``>= L`` add ``log(cluster size)`` to the attention logits of the merged token (proportional attention, on
  unless ``no_proportional_attention``), at the prefill and at every decoding step.

Here (``kvbench.compress.presses.visual``), in the prefill chunk that holds the visual tokens, the same EUTI
and DBDPC run at layer ``L`` before its attention (queries and keys unrotated with the ``cos``/``sin`` the
model passed to that attention, captured by a hook, so it holds for M-RoPE too; ``h`` captured by a hook on
decoder layer ``L``; the non-text tokens are those of the chunk up to the last visual one). What differs, and
why: the model's hidden-state sequence is not ours to shorten, so the merge is made on the cache. In every
layer ``>= L`` a cluster of two or more becomes one key/value at the centre's position: the mean of its
members' values and of their keys before RoPE, rotated at the centre's position, stands in for the K/V the
original computes from the mean hidden state (equal up to the layer norm's non-linearity at layer ``L``;
beyond ``L`` the members' own residual streams, not their mean, produce them). Every other member and the
dropped tokens are hidden from the kept queries during that chunk and evicted at its commit; the bias
``log(size)`` is added to the merged keys' logits while the chunk and every later step read them. Merged
tokens count as stored tokens in KR.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvbench.compress.cache import KVView, decoder_layers
from kvbench.compress.presses.divprune import cosine_distances
from kvbench.compress.presses.visual import (
    Reduction,
    VisualLayer,
    VisualPress,
    VisualState,
    attention_received,
    check_layer,
    check_share,
)

#: a DBDPC round that finds fewer centres than this switches to the sequential visit (``fit_variant``)
PARALLEL_MIN_CENTERS = 10


def euti_scores(q_pre: torch.Tensor, k_pre: torch.Tensor, visual: torch.Tensor, hidden_norm: torch.Tensor) -> torch.Tensor:
    """EUTI importance of the visual tokens (PACT's ``token_pruning`` with ``multiply_by_norm``).

    Args:
        q_pre: pre-RoPE queries ``[1, H_q, m, D]`` of the non-text tokens (every token up to the last visual one).
        k_pre: pre-RoPE keys ``[1, H_kv, m, D]`` of the same tokens (GQA: each KV head serves its query group).
        visual: int64 ``[n_vis]`` indices of the visual tokens among the ``m``.
        hidden_norm: float ``[n_vis]`` L2 norms of the visual tokens' layer-input hidden states.

    Returns:
        float32 ``[n_vis]``: softmax(mean_rows(q) · k / sqrt(D)) over the ``m`` keys, mean over query heads, at
        ``visual``, times ``hidden_norm``.
    """
    return attention_received(q_pre.float().mean(2, keepdim=True), k_pre)[visual] * hidden_norm.float()


def euti_keep(scores: torch.Tensor, keep: float) -> torch.Tensor:
    """Bool ``[n]``: the ``max(1, int(n · keep))`` highest ``scores``, ties to the lowest index (PACT's threshold
    with its tie fix-up; at least one, where the original would index an empty sort)."""
    n = scores.shape[0]
    k = min(n, max(1, int(n * keep)))
    order = torch.sort(scores, descending=True, stable=True).indices
    mask = torch.zeros(n, dtype=torch.bool, device=scores.device)
    mask[order[:k]] = True
    return mask


def _distances(x: torch.Tensor) -> torch.Tensor:
    d = cosine_distances(x).clamp_min(0)
    return d.fill_diagonal_(0)


def dbdpc_centers(x: torch.Tensor, cutoff: float, dc: float = 2.0) -> torch.Tensor:
    """DBDPC's cluster centres of the rows of ``x`` ``[n, f]`` (PACT ``DBDPC.fit_variant``; module docstring).

    Returns:
        int64 ``[C]`` row indices, in the order found (parallel rounds, then the sequential visit).
    """
    d = _distances(x)
    n = d.shape[0]
    density = torch.exp(-(d / dc) ** 2).sum(1)
    rank = torch.empty(n, dtype=torch.float32, device=d.device)
    rank[torch.argsort(density, stable=True)] = torch.arange(n, dtype=torch.float32, device=d.device)
    free = torch.ones(n, dtype=torch.bool, device=d.device)
    centers: list[int] = []
    while bool(free.any()):
        idx = free.nonzero().flatten()
        r = rank[idx]
        denser = r.view(1, -1) >= r.view(-1, 1)                  # [i, j]: j at least as dense as i
        denser.fill_diagonal_(False)
        delta = torch.where(denser, d[idx][:, idx], torch.full_like(d[idx][:, idx], math.inf)).amin(1)
        delta[r == r.max()] = math.inf
        new = idx[delta > cutoff]
        if new.numel() == 0:
            break
        centers += new.tolist()
        free[idx[(d[idx][:, new] <= cutoff).any(1)]] = False
        free[new] = False
        if new.numel() < PARALLEL_MIN_CENTERS:
            rest = idx[delta <= cutoff]
            rest = rest[torch.argsort(-rank[rest], stable=True)]
            rest = rest[(d[rest][:, centers] > cutoff).all(1)]
            near = d[rest][:, rest] <= cutoff
            taken = torch.zeros(len(rest), dtype=torch.bool, device=d.device)
            for a, i in enumerate(rest.tolist()):
                if not taken[a]:
                    centers.append(i)
                    taken[a + 1:] |= near[a, a + 1:]
            break
    return torch.tensor(centers, dtype=torch.long, device=d.device)


def pact_clusters(vectors: torch.Tensor, kept: torch.Tensor, cutoff: float, dc: float = 2.0,
                  coef_pruned: float = 1.5) -> torch.Tensor:
    """Cluster of every visual token: int64 ``[n]``, the index (among the ``n``) of its cluster's centre, or −1
    for a dropped token.

    Args:
        vectors: ``[n, f]`` clustering vectors (layer ``L``'s post-RoPE keys, heads flattened).
        kept: bool ``[n]``, the tokens EUTI kept (at least one).
        cutoff, dc: DBDPC's (:func:`dbdpc_centers` on the kept rows); every kept token joins its nearest centre.
        coef_pruned: a pruned token joins its nearest centre if within ``coef_pruned · cutoff`` (distance
            ``1 − cos``), else it is dropped.
    """
    kidx = kept.nonzero().flatten()
    centers = kidx[dbdpc_centers(vectors[kidx], cutoff, dc)]
    assign = torch.full((vectors.shape[0],), -1, dtype=torch.long, device=vectors.device)
    d_kept = _distances(vectors[kidx])[:, torch.searchsorted(kidx, centers)]            # [n_kept, C]
    assign[kidx] = centers[d_kept.argmin(1)]
    assign[centers] = centers
    pidx = (~kept).nonzero().flatten()
    if pidx.numel():
        u = F.normalize(vectors.float(), dim=-1)
        dist, near = (1.0 - u[pidx] @ u[centers].T).min(1)
        assign[pidx] = torch.where(dist <= cutoff * coef_pruned, centers[near], -1)
    return assign


def reduction_of(positions: torch.Tensor, assign: torch.Tensor, start: int) -> Reduction:
    """The :class:`Reduction` of a clustering ``assign`` (:func:`pact_clusters`) of the visual ``positions``:
    every token but the centres removed; clusters of two or more merged into their centre."""
    center = assign == torch.arange(len(assign), device=assign.device)
    sizes = torch.bincount(assign[assign >= 0], minlength=len(assign))
    merged = center & (sizes >= 2)
    centers = merged.nonzero().flatten()                                   # indices among the visual tokens
    member = (assign >= 0) & merged[assign.clamp_min(0)]
    members = member.nonzero().flatten()
    member_of = torch.searchsorted(centers, assign[members])
    return Reduction(start=start, removed=positions[~center], centers=positions[centers], members=positions[members],
                     member_of=member_of, log_size=sizes[centers].float().log())


class PACTLayer(VisualLayer):
    """A :class:`VisualLayer` that also merges PACT's clusters from layer ``L`` on and adds the proportional
    attention bias; hooks capture the ``cos``/``sin`` its attention is given (and, at layer ``L``, the layer's
    input hidden states, for EUTI)."""

    _cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None
    _merged: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def attach(self, attn: Any) -> list:
        if self.ctx.layer_idx < self.press.layer:
            return []

        def rope_of(module, args, kwargs):
            self._cos_sin = kwargs.get("position_embeddings")

        handles = [attn.register_forward_pre_hook(rope_of, with_kwargs=True)]
        if self.ctx.layer_idx == self.press.layer:
            def hidden_of(module, args, kwargs):
                self.state.extra["hidden"] = args[0] if args else kwargs["hidden_states"]

            handles.append(self.state.extra["decoder"].register_forward_pre_hook(hidden_of, with_kwargs=True))
        return handles

    def _unrotate(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Pre-RoPE ``x`` ``[1, H, k, D]`` of the chunk rows ``rows`` (int64 ``[k]``), with the captured cos/sin."""
        if self._cos_sin is None:
            raise RuntimeError("pact: the attention's position_embeddings were not captured (model without them?)")
        cos, sin = (c[:, rows] for c in self._cos_sin)
        return self.ctx.apply_rope(x[:, :1, :1], x, cos, -sin)[1]

    def _rotate(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        cos, sin = (c[:, rows] for c in self._cos_sin)
        return self.ctx.apply_rope(x[:, :1, :1], x, cos, sin)[1]

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
               scaling: float | None) -> torch.Tensor:
        """SDPA over the view with the merged clusters: in the selection chunk the centres' K/V become their
        clusters' (kept for the commit); the merged keys get ``+log(size)`` (``press.proportional``)."""
        red = self.state.reduction
        if red is None or red.centers is None or red.centers.numel() == 0 or self.ctx.layer_idx < red.start:
            return super().attend(query, key, value, mask, scaling)
        pos = self._view.positions[0, 0]
        at = torch.searchsorted(pos, red.centers)                               # the centres' slots in the view
        if self._reducing:
            key, value = key.clone(), value.clone()
            n, t = key.shape[-2], query.shape[2]
            slots = torch.searchsorted(pos, red.members)
            k_pre = self._unrotate(key[:, :, slots], slots - (n - t)).float()
            size = red.log_size.exp().view(1, 1, -1, 1)
            k_sum = torch.zeros(*k_pre.shape[:2], len(at), k_pre.shape[-1], device=key.device)
            k_mean = k_sum.index_add_(2, red.member_of, k_pre) / size
            v_sum = torch.zeros_like(k_sum).index_add_(2, red.member_of, value[:, :, slots].float())
            key[:, :, at] = self._rotate(k_mean.to(key.dtype), at - (n - t))
            value[:, :, at] = (v_sum / size).to(value.dtype)
            self._merged = (at, key[:, :, at], value[:, :, at])
        if not self.press.proportional:
            return super().attend(query, key, value, mask, scaling)
        bias = torch.zeros(len(pos), dtype=query.dtype, device=query.device)
        bias[at] = red.log_size.to(query.dtype)
        bias = bias.view(1, 1, 1, -1)
        if mask is not None:
            bias = torch.where(mask, bias, -math.inf)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=bias, scale=scaling, enable_gqa=True)

    def reduce_stored(self, red: Reduction) -> None:
        """Write the merged K/V at the centres' slots, then evict every other removed position."""
        if self._merged is not None:
            at, k, v = self._merged
            stored = self._stored
            keys, values = stored.keys.clone(), stored.values.clone()
            keys[:, :, at], values[:, :, at] = k, v
            self._stored = KVView(keys, values, stored.positions)
            self._merged = None
        super().reduce_stored(red)

    def reset(self) -> None:
        super().reset()
        self._cos_sin = self._merged = None

    def commit(self, chunk: KVView, query: torch.Tensor) -> None:
        super().commit(chunk, query)
        self._cos_sin = None     # the step's tensors are not held between steps
        if self.ctx.layer_idx == self.press.layer:
            self.state.extra.pop("hidden", None)


@dataclass
class PACTPress(VisualPress):
    """PACT (Dhouib et al., CVPR 2025): EUTI pruning then DBDPC clustering and merging of the visual tokens at
    layer ``layer``; layers below keep every token (module docstring).

    Parameters (defaults: the original's LLaVA-OneVision-7B run, ``configs/pact.json`` +
    ``scripts/pact_llava-onevision7b.sh``; its Qwen2-VL-7B run uses ``cutoff=0.1, keep=0.8``)
    ----------
    layer : int, 4 — ``layer_for_reduction``.
    keep : float, 0.55 — share of the visual tokens EUTI keeps (``pruning_tokeep_percentage_value``); count
        ``int(keep · n_vis)``, at least 1.
    cutoff : float, 0.21 — DBDPC's cutoff distance (cosine distance, in [0, 2]); 0 with ``keep=1.0`` merges only
        identical keys (the full cache on real-valued keys).
    dc : float, 2.0 — DBDPC's density bandwidth (``DBDPC(dc=2)``).
    coef_pruned : float, 1.5 — a pruned token within ``coef_pruned · cutoff`` of a centre joins its cluster.
    proportional : bool, True — add ``log(cluster size)`` to the merged keys' logits (proportional attention).

    Raises ValueError for ``layer`` not an int >= 0, ``keep`` outside (0, 1], ``cutoff`` outside [0, 2],
    ``dc`` <= 0, ``coef_pruned`` < 0, or (:meth:`check_layers`) a ``layer`` the model does not have; at the
    prefill, for a request without visual tokens or whose visual tokens cross a prefill chunk.
    """

    name = "pact"
    #: keep every token and merge only identical keys; layer 1 so the registry-driven check runs on its 3-layer LM
    exact = {"keep": 1.0, "cutoff": 0.0, "layer": 1}
    layer_class = PACTLayer
    layer: int = 4
    keep: float = 0.55
    cutoff: float = 0.21
    dc: float = 2.0
    coef_pruned: float = 1.5
    proportional: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_layer("layer", self.layer)
        check_share("keep", self.keep)
        if not 0.0 <= self.cutoff <= 2.0:
            raise ValueError(f"cutoff (a cosine distance) must be in [0, 2], got {self.cutoff!r}")
        if not self.dc > 0:
            raise ValueError(f"dc (DBDPC's density bandwidth) must be > 0, got {self.dc!r}")
        if not self.coef_pruned >= 0:
            raise ValueError(f"coef_pruned must be >= 0, got {self.coef_pruned!r}")

    def check_layers(self, n_layers: int) -> None:
        if self.layer >= n_layers:
            raise ValueError(f"pact layer={self.layer} is outside the model's {n_layers} layers")

    def prepare(self, model: Any, state: VisualState) -> None:
        state.extra["decoder"] = decoder_layers(model)[self.layer]

    def select_layer(self, n_layers: int) -> int:
        return self.layer

    def select(self, layer: PACTLayer, query: torch.Tensor, view: KVView) -> Reduction:
        """EUTI on this chunk's non-text rows, then :func:`pact_clusters` on the kept tokens' post-RoPE keys."""
        vis = layer.cache.visual
        n, t = len(view), query.shape[2]
        lo = n - t                                                             # view index of the chunk's first row
        last = layer.state.last
        rows = torch.arange(0, last - (layer.seen - t) + 1, device=query.device)   # chunk rows up to the last visual
        q_pre = layer._unrotate(query[:, :, rows], rows)
        k_pre = layer._unrotate(view.keys[:, :, lo + rows], rows)
        vrows = vis.positions - (layer.seen - t)
        hidden = layer.state.extra["hidden"][0, vrows]
        scores = euti_scores(q_pre, k_pre, vrows, hidden.float().norm(dim=-1))
        kept = euti_keep(scores, self.keep)
        keys = view.keys[0, :, lo + vrows].transpose(0, 1).flatten(1)          # [n_vis, H_kv · D]
        assign = pact_clusters(keys, kept, self.cutoff, self.dc, self.coef_pruned)
        return reduction_of(vis.positions, assign, self.layer)
