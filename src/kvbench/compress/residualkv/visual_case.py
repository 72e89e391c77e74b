"""ResidualKV's visual case (arXiv 2602.08005v2 §V-E, Fig. 13): which earlier tokens each visual token of
one image is coded against.

The paper marks a target visual token and draws lines to the references retrieved for it (a sandwich's edge matching
other edges, a cat's ear another ear). Here the same question is answered for one image of one VLM record, with the
references the cache really stores:

- K‖V: the pre-RoPE ``k_proj ‖ v_proj`` output of each layer over the record's whole prompt, as the full VLM eval
  encodes it (:func:`kvbench.compress.generate_vlm.encode_vlm`), captured as Fig. 3 captures it
  (:func:`kvbench.compress.residualkv.observations.layer_kv`). The prompt's context chunk, which holds every image,
  is prefilled exactly by the ResidualKV cache (coding happens after the chunk's view is built), so these are the
  values it codes; later chunks cannot change them (causal).
- References: as :meth:`kvbench.compress.residualkv.cache.ResidualKVLayer._compress` computes them
  (:func:`stored_references`): the schedule of the press's :meth:`~kvbench.compress.residualkv.cache.ResidualKVPress.schedule`
  (the trained codec's ``k``, ``n_sink``, ``stride``, ``alpha``, ``grid``, with the press's inference overrides), the
  pool of reference positions at or after ``n_sink`` (:func:`~kvbench.compress.residualkv.references.references_between`,
  sinks stay raw and are never in the pool), stored FP8 e4m3 when the press's ``ref_fp8`` is set, and each coded
  token's ``k`` nearest pool entries at EARLIER positions by squared L2
  (:func:`~kvbench.compress.residualkv.references.nearest_references`, causal). The pool only grows in position order,
  so a token's references do not depend on when it leaves the raw window.
- Patches: visual token ``i`` of an image with merged grid ``(t, h, w)`` (``image_grid_thw`` over the spatial merge
  size, :func:`kvbench.compress.generate_vlm.merged_grids`, :class:`kvbench.compress.cache.VisualTokens`) is frame
  ``i // (h w)``, row ``(i mod h w) // w``, column ``i mod w`` (row-major, the order of the model's M-RoPE (t, h, w)
  positions).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from kvbench.compress.cache import decoder_layers
from kvbench.compress.generate_vlm import encode_vlm, merged_grids, visual_positions
from kvbench.compress.residualkv import references
from kvbench.compress.residualkv.codec import model_kv_shape
from kvbench.compress.residualkv.observations import ReferenceSchedule, layer_kv
from kvbench.kernels import quant


@dataclass(frozen=True)
class StoreSchedule:
    """The reference settings a ResidualKV cache codes with: the retrieval's (:class:`ReferenceSchedule`), whether the
    reference pool is stored FP8 (``ref_fp8``), and the layers kept whole (``full_layers``: no references there).

    Raises:
        ValueError: a bad schedule (:class:`ReferenceSchedule`'s checks) or a negative full layer.
    """

    refs: ReferenceSchedule
    ref_fp8: bool = True
    full_layers: tuple[int, ...] = ()
    #: ``(n_layers, d_kv)`` the codec was trained for (None: not known, e.g. a schedule built by hand)
    codec_shape: tuple[int, int] | None = None
    #: the trained codec's directory (named in the CSV header)
    codec_dir: str | None = None

    def __post_init__(self):
        if any(i < 0 for i in self.full_layers):
            raise ValueError(f"full_layers must be layer indices >= 0, got {self.full_layers}")

    @classmethod
    def of_press(cls, press: Any) -> "StoreSchedule":
        """The schedule of a :class:`~kvbench.compress.residualkv.cache.ResidualKVPress` (its trained codec read):
        :meth:`~kvbench.compress.residualkv.cache.ResidualKVPress.schedule`, ``ref_fp8`` and ``full_layers``.

        Raises:
            ValueError: the press's codec has no references (Table VIII's ablation: nothing to draw), or none is
                trained in its ``codec_dir``.
        """
        cfg = press.schedule()
        if not cfg.references:
            raise ValueError(f"codec {press.codec_dir!r} codes without references (references: false): "
                             "a visual case has no reference to draw")
        refs = ReferenceSchedule(k=cfg.k, n_sink=cfg.n_sink, stride=cfg.stride, alpha=cfg.alpha, grid=cfg.grid,
                                 block=max(1, cfg.window))
        return cls(refs, bool(press.ref_fp8), tuple(press.full_layers), (int(cfg.n_layers), int(cfg.d_kv)),
                   str(press.codec_dir))

    def describe(self) -> str:
        return (f"{self.refs.describe()}; references stored {'FP8 e4m3' if self.ref_fp8 else 'float32'}; "
                f"full layers {list(self.full_layers)}" + (f"; codec {self.codec_dir}" if self.codec_dir else ""))


@dataclass
class TokenReferences:
    """One layer's references, as the cache stores them (:func:`stored_references`).

    Attributes:
        ref_positions: int64 ``[R]``, ascending positions of the reference pool.
        positions: int64 ``[N]``, ascending positions of the coded tokens (neither sinks nor references).
        refs: int64 ``[N, k]``, each coded token's references as POSITIONS, nearest first; -1 in invalid slots.
        valid: bool ``[N, k]``, the first ``min(k, visible references)`` slots.
        sq_dist: float32 ``[N, k]``, squared L2 distance to each reference (the codec's ranking; NaN where invalid).
        cosine: float32 ``[N, k]``, cosine similarity to each reference (NaN where invalid).
    """

    ref_positions: torch.Tensor
    positions: torch.Tensor
    refs: torch.Tensor
    valid: torch.Tensor
    sq_dist: torch.Tensor
    cosine: torch.Tensor


def stored_references(kv: torch.Tensor, schedule: StoreSchedule) -> TokenReferences:
    """Each coded token's ``k`` nearest earlier references in one layer, as
    :meth:`kvbench.compress.residualkv.cache.ResidualKVLayer._compress` finds them (module docstring): the pool is the
    reference positions in ``[n_sink, T)`` of :func:`~kvbench.compress.residualkv.references.references_between`
    (called as the cache calls it), stored with :func:`~kvbench.kernels.quant.cast_fp8` when ``ref_fp8``
    (as :class:`~kvbench.compress.residualkv.store.RefPool` stores it) and read back as float32; the search is
    :func:`~kvbench.compress.residualkv.references.nearest_references` over it (causal, ties to the lower index).

    Args:
        kv: float ``[T, D]``, the layer's pre-RoPE K‖V of positions 0..T-1.
        schedule: the cache's settings (:meth:`StoreSchedule.of_press`).

    Returns:
        :class:`TokenReferences` (no coded token: empty tensors).

    Raises:
        ValueError: ``kv`` not 2-D or not finite (from the retrieval).
    """
    if kv.dim() != 2:
        raise ValueError(f"expected kv [T, D], got shape {tuple(kv.shape)}")
    x = kv.to(torch.float32)
    n, s = x.shape[0], schedule.refs
    # the cache's _ref_offsets over its flushed blocks, which start at n_sink: sinks are never pooled
    ref_pos = torch.tensor(references.references_between(s.n_sink, n, n_sink=s.n_sink, stride=s.stride,
                                                          alpha=s.alpha, grid=s.grid), dtype=torch.long)
    coded = torch.ones(n, dtype=torch.bool)
    coded[: s.n_sink] = False
    coded[ref_pos] = False
    pos = torch.arange(n)[coded]
    pool = x[ref_pos]
    if schedule.ref_fp8:
        pool = quant.cast_fp8(pool)[0].to(torch.float32)
    k = s.k
    if pos.numel() == 0:
        empty = torch.zeros(0, k)
        return TokenReferences(ref_pos, pos, torch.zeros(0, k, dtype=torch.long), torch.zeros(0, k, dtype=torch.bool),
                               empty, empty.clone())
    idx, valid = references.nearest_references(x[pos], pos, pool, ref_pos, k)
    tok, got = x[pos][:, None, :], pool[idx]                                            # [N, 1, D], [N, k, D]
    sq = (tok - got).pow(2).sum(-1)
    cos = torch.nn.functional.cosine_similarity(tok, got, dim=-1)
    nan = torch.tensor(float("nan"))
    return TokenReferences(ref_pos, pos, torch.where(valid, ref_pos[idx], -1), valid,
                           torch.where(valid, sq, nan), torch.where(valid, cos, nan))


def patch_coords(grids: Sequence[tuple[int, int, int]]) -> torch.Tensor:
    """Image, frame, row and column of every visual token: int64 ``[n_vis, 4]`` for images with merged grids
    ``grids`` (per image ``(t, h, w)``, prompt order; :class:`~kvbench.compress.cache.VisualTokens`), row-major within
    each frame: token ``i`` of an image is frame ``i // (h w)``, row ``(i mod h w) // w``, column ``i mod w``.

    Raises:
        ValueError: a grid with a non-positive side.
    """
    out = []
    for g, (t, h, w) in enumerate(grids):
        if min(t, h, w) < 1:
            raise ValueError(f"image {g}: merged grid (t, h, w) = {(t, h, w)} has a side below 1")
        i = torch.arange(t * h * w)
        out.append(torch.stack([torch.full_like(i, g), i // (h * w), i % (h * w) // w, i % w], dim=1))
    return torch.cat(out) if out else torch.zeros(0, 4, dtype=torch.long)


@dataclass
class VisualCase:
    """:func:`visual_case`'s result: one image of one record and its visual tokens' references per layer.

    Attributes:
        record: the record's id. task: its task. image: the image drawn (index among the record's images).
        model: the model's name. schedule: the cache's settings.
        n_tokens: prompt length T. visual: int64 ``[n_vis]`` positions of every visual token of the prompt (all
            images). coords: int64 ``[n_vis, 4]`` their (image, frame, row, column) (:func:`patch_coords`).
        grids: per image ``(t, h, w)`` merged grid. tokens: the prompt's token strings ``[T]`` (a text
            reference's label). layers: ``{layer: TokenReferences}``.
    """

    record: str
    task: str
    image: int
    model: str
    schedule: StoreSchedule
    n_tokens: int
    visual: torch.Tensor
    coords: torch.Tensor
    grids: list[tuple[int, int, int]]
    tokens: list[str]
    layers: dict[int, TokenReferences] = field(default_factory=dict)


def check_layers(layers: Sequence[int], n_layers: int, schedule: StoreSchedule) -> list[int]:
    """``layers`` as a list, checked: at least one, no repeat, each a decoder layer of the model that the cache codes.

    Raises:
        ValueError: naming the bad layers (outside 0..n_layers-1, repeated, or a full-attention layer of the press,
            whose K/V are kept whole, so it has no references).
    """
    layers = [int(i) for i in layers]
    if not layers:
        raise ValueError("layers: give at least one decoder layer to draw")
    if len(set(layers)) != len(layers):
        raise ValueError(f"layers {layers}: a layer is given twice")
    bad = [i for i in layers if not 0 <= i < n_layers]
    if bad:
        raise ValueError(f"layers {bad} outside the model's {n_layers} decoder layers (0..{n_layers - 1})")
    full = [i for i in layers if i in schedule.full_layers]
    if full:
        raise ValueError(f"layers {full} are full-attention layers of the ResidualKV press (full_layers "
                         f"{list(schedule.full_layers)}): their K/V are stored whole, with no references; pick sparse layers")
    return layers


@torch.inference_mode()
def visual_case(model: Any, proc: Any, record: dict, base_dir: str | Path | None, schedule: StoreSchedule,
                layers: Sequence[int], *, image: int = 0, task: str = "", model_name: str = "") -> VisualCase:
    """Run ``record`` through ``model`` once (its whole prompt, no cache) and find, in each of ``layers``, the
    references the ResidualKV cache stores for its tokens (module docstring).

    Args:
        model, proc: a VLM with a merged patch grid (Qwen2.5-VL, Qwen3-VL: ``image_grid_thw`` and
            ``spatial_merge_size``) and its processor, eval mode.
        record: a ``kind: vlm`` record (benchmark format); image paths relative to ``base_dir``.
        schedule: the cache's settings (:meth:`StoreSchedule.of_press` of the press the table ran).
        layers: decoder layers to analyse (sparse layers of the press).
        image: which of the record's images is drawn (0-based, prompt order); every image's tokens are analysed.

    Raises:
        ValueError: a record that is not a VLM record, a model without a merged patch grid (e.g. LLaVA-style anyres
            tiles), ``image`` outside the record's images, bad ``layers`` (:func:`check_layers`), or a codec trained
            for another ``(n_layers, d_kv)`` than the model's.
    """
    rid = record.get("id")
    if record.get("kind") != "vlm":
        raise ValueError(f"record {rid!r} is kind {record.get('kind')!r}: a visual case needs a VLM record (kind: vlm)")
    layers = check_layers(layers, len(decoder_layers(model)), schedule)
    shape = model_kv_shape(model)
    if schedule.codec_shape is not None and tuple(schedule.codec_shape) != shape:
        # another model's codec would draw another schedule's references without any error
        raise ValueError(f"the codec was trained for (n_layers, d_kv) = {tuple(schedule.codec_shape)}, model "
                         f"{model_name or type(model).__name__} has {shape}: give the codec of this model")
    inputs = encode_vlm(model, proc, record, base_dir)
    ids = inputs["input_ids"]
    vis = visual_positions(model, ids).cpu()
    grids = merged_grids(model, inputs, len(vis))
    if not len(vis):
        raise ValueError(f"record {rid!r}: its prompt holds no visual token")
    if not grids:
        raise ValueError(f"model {model_name or type(model).__name__}: no merged patch grid for record {rid!r} "
                         "(image_grid_thw and vision_config.spatial_merge_size, as Qwen2.5-VL/Qwen3-VL give), so visual "
                         "tokens cannot be placed on patches; LLaVA-style anyres tiles are not mapped")
    if not 0 <= image < len(grids):
        raise ValueError(f"image {image}: record {rid!r} has {len(grids)} image(s) (0..{len(grids) - 1})")
    kv = layer_kv(model, inputs, layers)
    tok = getattr(proc, "tokenizer", proc)
    return VisualCase(record=str(rid), task=task, image=image, model=model_name, schedule=schedule,
                      n_tokens=int(ids.shape[1]), visual=vis, coords=patch_coords(grids), grids=grids,
                      tokens=tok.convert_ids_to_tokens(ids[0].tolist()),
                      layers={i: stored_references(x, schedule) for i, x in zip(layers, kv)})
