"""Preallocated tensors that grow geometrically, written in place: the storage of the compressed caches.

A decode step adds one token to a cache of n. ``torch.cat`` of the whole cache per step copies O(n) bytes
to add O(1); a buffer with spare capacity writes the new rows in place and copies everything only when it
grows by an eighth (O(1) amortised per token), as a paged or static KV cache does. Views (``[..., :n, ...]``) of the
buffer are what attention reads, so the full cache reads its keys once per step.

Resident bytes (:func:`~kvbench.compress.accounting.held_bytes`) count a view's whole storage, so a
buffer's spare capacity (at most an eighth of the stored length, or :data:`MIN_GROWTH` rows) is counted as held: it
is allocated.
"""
from __future__ import annotations

import torch

#: ``(keys [1, H, n, D], values [1, H, n, D], positions int64 [1, H, n])``
Triple = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


#: rows a :class:`Growable` adds at least when it grows (a decode step must not reallocate a short store every time)
MIN_GROWTH = 64


class Growable:
    """A tensor grown along dim ``dim`` in preallocated storage, grown geometrically (:meth:`reserve`).

    Parameters:
        dim: the growing dimension (negative counts from the end).
        fill: value of fresh capacity (None: uninitialised, never read; e.g. -1 for a lookup map).
    """

    def __init__(self, dim: int = 0, fill: int | float | None = None):
        self.dim, self.fill = dim, fill
        self.data: torch.Tensor | None = None
        self.n = 0   # rows in use

    def __len__(self) -> int:
        return self.n

    @property
    def capacity(self) -> int:
        return 0 if self.data is None else self.data.shape[self.dim]

    def reserve(self, like: torch.Tensor, n: int) -> None:
        """Capacity for at least ``n`` rows, in ``like``'s dtype, device and other dims. The first call allocates
        exactly ``n``; a later growth adds at least an eighth of the capacity (and :data:`MIN_GROWTH` rows), so
        appends cost O(1) amortised (about 8 rows copied per row appended) while the spare capacity a cache holds
        between steps, which its resident bytes count, stays within 1/8 of its rows for a long context (doubling
        held up to as much again: docs/decisions/residualkv.md, "One contiguous store per layer")."""
        if self.data is not None and n <= self.capacity:
            return
        cap = n if self.data is None else max(n, self.capacity + max(self.capacity // 8, MIN_GROWTH))
        shape = list(like.shape)
        shape[self.dim] = cap
        new = (torch.empty(shape, dtype=like.dtype, device=like.device) if self.fill is None
               else torch.full(shape, self.fill, dtype=like.dtype, device=like.device))
        if self.n:
            new.narrow(self.dim, 0, self.n).copy_(self.view())
        self.data = new

    def slot(self, start: int, length: int) -> torch.Tensor:
        """The rows ``[start, start + length)`` of the storage (capacity reserved by the caller), to write."""
        return self.data.narrow(self.dim, start, length)

    def append(self, x: torch.Tensor) -> None:
        """Copy ``x`` (same dims but ``dim``) after the rows in use."""
        t = x.shape[self.dim]
        self.reserve(x, self.n + t)
        self.slot(self.n, t).copy_(x)
        self.n += t

    def view(self) -> torch.Tensor | None:
        """The rows in use (a view of the storage), None before the first append."""
        return None if self.data is None else self.data.narrow(self.dim, 0, self.n)

    def drop_front(self, m: int) -> None:
        """Drop the first ``m`` rows: the rest moves to the front of a fresh storage of twice their number (at
        most the old capacity; a copy of the kept rows, once per call, source and destination never overlap).
        Not the old capacity: a raw window that first took a whole prefill chunk would otherwise hold that
        chunk's size for the rest of the request (docs/decisions/residualkv.md, "One contiguous store per layer")."""
        if m <= 0 or self.data is None:
            return
        kept = self.n - m
        rest = self.data.narrow(self.dim, m, kept)
        shape = list(self.data.shape)
        shape[self.dim] = min(self.capacity, max(1, 2 * kept))
        new = self.data.new_empty(shape) if self.fill is None else self.data.new_full(shape, self.fill)
        new.narrow(self.dim, 0, kept).copy_(rest)
        self.data, self.n = new, kept

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (int64 indices or a bool mask over the rows in use), in that order; the storage
        is rebuilt at exactly the kept size (a per-request operation, e.g. an eviction)."""
        self.set(self.view().index_select(self.dim, rows.nonzero().flatten() if rows.dtype == torch.bool else rows))

    def set(self, x: torch.Tensor | None) -> None:
        """Hold ``x`` as the rows in use (adopted, not copied: its capacity is its length); None empties."""
        self.data, self.n = x, (0 if x is None else x.shape[self.dim])


class KVBuffer:
    """Keys and values ``[1, H, n, D]`` and int64 positions of stored tokens in :class:`Growable` storage.

    Positions are one ``[n]`` row shared by every head while every head holds the same tokens (the view
    expands it, stride 0 over heads, as :meth:`~kvbench.compress.cache.KVView.dense`), and ``[1, H, n]`` once
    a head-wise eviction gave heads different tokens (:meth:`replace` with such positions). Views are
    ``(keys, values, positions [1, H, n])`` tuples, so this module needs nothing from the cache.
    """

    def __init__(self):
        self.keys, self.values = Growable(2), Growable(2)
        self.pos = Growable(0)
        self.per_head = False

    def __len__(self) -> int:
        return len(self.keys)

    def stage(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> Triple:
        """Write a chunk (``keys``/``values`` ``[1, H, t, D]``, ``positions`` ``[1, H, t]``) after the stored
        tokens without counting it (:meth:`commit_staged` does) and return stored + chunk as one view: the
        in-place form of ``torch.cat([stored, chunk], -2)``."""
        n, t = len(self), keys.shape[-2]
        for g, x in ((self.keys, keys), (self.values, values)):
            g.reserve(x, n + t)
            g.slot(n, t).copy_(x)
        pos = self._pos_rows(positions, keys.shape[1])
        self.pos.reserve(pos, n + t)
        self.pos.slot(n, t).copy_(pos)
        return self._view(n + t)

    def commit_staged(self, t: int) -> None:
        """Count the ``t`` tokens of the last :meth:`stage` as stored."""
        for g in (self.keys, self.values, self.pos):
            g.n += t

    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Store a chunk after the stored tokens (a copy into the spare capacity)."""
        self.stage(keys, values, positions)
        self.commit_staged(keys.shape[-2])

    def view(self) -> Triple | None:
        """The stored tokens as one view (None while nothing is stored)."""
        return self._view(len(self)) if len(self) else None

    def drop_front(self, m: int) -> None:
        """Forget the ``m`` oldest stored tokens (a sliding raw window)."""
        for g in (self.keys, self.values, self.pos):
            g.drop_front(m)

    def replace(self, view: Triple | None) -> None:
        """Hold exactly ``view``'s tokens (adopted, not copied; e.g. after an eviction); None empties."""
        if view is None:
            for g in (self.keys, self.values, self.pos):
                g.set(None)
            self.per_head = False
            return
        keys, values, positions = view
        self.keys.set(keys)
        self.values.set(values)
        self.per_head = not shared_over_heads(positions)
        self.pos = Growable(2 if self.per_head else 0)
        self.pos.set(positions if self.per_head else positions[0, 0])

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        """The storages held (for the resident bytes; each counts its whole capacity)."""
        return self.keys.data, self.values.data, self.pos.data

    def _pos_rows(self, positions: torch.Tensor, heads: int) -> torch.Tensor:
        """``positions`` ``[1, H, t]`` in this buffer's layout, switching the buffer to per-head rows when a
        chunk's heads differ."""
        if not self.per_head and not shared_over_heads(positions):
            old = self.pos.view()
            self.per_head = True
            self.pos = Growable(2)
            if old is not None and len(old):
                self.pos.append(old.view(1, 1, -1).expand(1, heads, -1))
        return positions.expand(1, heads, -1) if self.per_head else positions[0, 0]

    def _view(self, n: int) -> Triple:
        keys, values = self.keys.data.narrow(2, 0, n), self.values.data.narrow(2, 0, n)
        if self.per_head:
            return keys, values, self.pos.data.narrow(2, 0, n)
        return keys, values, self.pos.data.narrow(0, 0, n).view(1, 1, -1).expand(1, keys.shape[1], -1)


def shared_over_heads(positions: torch.Tensor) -> bool:
    """True when ``positions`` ``[1, H, n]`` is one row expanded over heads (a host-side stride test: reading
    the values would cost a device synchronisation), or has one head."""
    return positions.shape[1] == 1 or positions.stride(1) == 0
