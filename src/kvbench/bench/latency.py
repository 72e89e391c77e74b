"""CONDUIT Table 3 measurements: prefill FLOPs and time to first token, full prefill vs. each refresh policy.

TTFT is the wall time from a request (record + in-memory image caches) to its
first token (CONDUIT §4.3, batch size 1):

- refresh policies: processor encoding and assembly (stale keys re-rotated to
  the new positions, :func:`~kvbench.reuse.assemble.assemble`), the scoring
  pass where the policy has one, Phase 2, argmax of the last logits
  (:func:`serve_cached`). Both passes write into the assembled request's own
  K/V (``refresh(..., in_place=True)``): a serving engine holds one copy of
  the request's cache, not a second one per pass;
- full prefill: processor encoding and the model's own forward, vision tower
  included, with logits of the last position only (``logits_to_keep=1``, as a
  serving engine and ``generate`` do), argmax (:func:`serve_full`).

The image caches are built before timing and held in memory: the disk load of
a cache hit is not part of TTFT. The scoring pass is also timed on its own
(``scoring_ms``, on a request assembled afresh, untimed). Every configuration is run ``warmup`` times untimed, then
``repeats`` times; the methods of one context size are interleaved round-robin
within each repeat, so drifting machine load affects them alike. FLOPs come
from one extra, untimed run under ``FlopCounterMode`` and are checked against
:func:`~kvbench.bench.cost.analytic_cost`.

Output: one row per (context size, method, repeat); see :data:`RAW_COLUMNS`.
"""
from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvbench.bench import BENCH_DEFAULTS, DTYPES, TABLE3_METHODS, clock, flops
from kvbench.bench.cost import analytic_cost
from kvbench.bench.requests import MAX_PAGE_PX, bench_record
from kvbench.data.digits import CELL_PX
from kvbench.bench.timing_model import TIMING_MODELS, build_timing_vlm, n_params
from kvbench.models import load_model
from kvbench.models.prompting import encode_record
from kvbench.reuse import (
    ImageKV,
    ImageKVStore,
    VLMAdapter,
    adapter_for,
    assemble,
    refresh,
)
from kvbench.reuse.policies import REFRESH, RefreshPolicy
from kvbench.reuse.scoring import scoring_pass
from kvbench.reuse.validate import check_ratio
from kvbench.utils.spec import parse

#: Columns of the raw measurement CSV (units in the names: ms, FLOPs as integers).
RAW_COLUMNS = [
    "model", "device", "dtype", "threads", "torch", "pages", "page_px", "seq_len", "n_visual", "n_text",
    "n_query", "r", "method", "refreshed_visual", "repeat", "ttft_ms", "assemble_ms", "scoring_ms",
    "flops", "flops_scoring", "flops_vision", "flops_analytic", "flops_analytic_scoring", "token",
]

_FULL_INPUTS = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids")


def table3_policy(method: str, r: float) -> RefreshPolicy:
    """The policy a Table 3 method names (its :attr:`~kvbench.reuse.policies.RefreshPolicy.label`, with the
    parameters after it, is the table's row name): ``<policy>`` or ``<policy>:key=value,...`` (a refresh spec without a
    budget: every method is timed at the run's ``r``), e.g. ``conduit:phase2_text=query`` (the authors' as-run
    Phase 2).

    Raises:
        ValueError: a budget in the name, an unknown policy or a bad parameter (naming the method).
    """
    if not isinstance(method, str) or "@" in method:
        raise ValueError(f"Table 3 method {method!r}: expected <policy>[:key=value,...] without a budget "
                         f"(every method is timed at r = {r})")
    name, _, params = method.partition(":")
    spec = name + ("" if name in REFRESH.fixed_r else f"@{r}") + (f":{params}" if params else "")
    try:
        return parse(spec, REFRESH).build()
    except ValueError as e:
        raise ValueError(f"Table 3 method {method!r}: {e}") from None


@dataclass
class LatencyConfig:
    """One benchmark run.

    Parameters:
        model: timing model name (:data:`~kvbench.bench.timing_model.TIMING_MODELS`, random weights, needs
            ``tokenizer``) or a local checkpoint directory / zoo name (:func:`kvbench.models.load_model`).
        tokenizer: tokenizer directory for timing models.
        sizes: pages per request, one context size each.
        page_px: page side in px (multiple of 28, at most 448).
        r: refresh ratio of the budgeted methods (Table 3: 0.10).
        methods: policies to run (``<policy>[:key=value,...]``, :func:`table3_policy`); ``full`` is always added
            as the reference.
        repeats, warmup: timed and untimed runs per configuration.
        threads: torch intra-op threads (None: leave as is).
        device: ``"auto"`` (CUDA when available, else CPU), ``"cpu"`` or ``"cuda[:i]"``.
        dtype: ``"auto"`` (bfloat16 on CUDA, float32 on CPU) or a torch dtype name.
        seed: weights of timing models and the records' draws.
    """

    model: str = BENCH_DEFAULTS["model"]
    tokenizer: str | None = None
    sizes: Sequence[int] = tuple(BENCH_DEFAULTS["sizes"])
    page_px: int = BENCH_DEFAULTS["page_px"]
    r: float = BENCH_DEFAULTS["r"]
    methods: Sequence[str] = field(default_factory=lambda: list(TABLE3_METHODS))
    repeats: int = BENCH_DEFAULTS["repeats"]
    warmup: int = BENCH_DEFAULTS["warmup"]
    threads: int | None = None
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0

    def validate(self) -> None:
        """Check every field before any model work.

        Raises:
            ValueError: bad ratio, repeats, sizes, page size or method (message names the value).
        """
        check_ratio(self.r)
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {self.repeats}, {self.warmup}")
        if not self.sizes or any(int(s) < 1 for s in self.sizes):
            raise ValueError(f"sizes must be page counts >= 1, got {list(self.sizes)}")
        if len(set(map(int, self.sizes))) != len(self.sizes):
            raise ValueError(f"sizes must be distinct page counts, got {list(self.sizes)} (one context each)")
        if self.page_px <= 0 or self.page_px % CELL_PX or self.page_px > MAX_PAGE_PX:
            raise ValueError(f"page_px must be a multiple of {CELL_PX} in {CELL_PX}..{MAX_PAGE_PX}, got {self.page_px}")
        for m in self.methods:
            table3_policy(m, self.r)
        if self.model in TIMING_MODELS and not self.tokenizer:
            raise ValueError(f"timing model {self.model!r} needs a tokenizer directory")


@dataclass
class Served:
    """One served request: first token, timings (ms) and, for cached paths, the request and result."""

    token: int
    ttft_ms: float
    assemble_ms: float | None = None
    req: Any = None
    result: Any = None


def resolve_device(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """``("auto", "auto")`` → CUDA + bfloat16 when available, else CPU + float32.

    Raises:
        ValueError: an unknown device or dtype, or a CUDA device on a machine without one (naming it).
    """
    try:
        dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                           ("cpu" if device == "auto" else device))
    except RuntimeError:
        raise ValueError(f"device {device!r}: expected auto, cpu, cuda or cuda:<index>") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested, but this machine has no CUDA device")
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {DTYPES}")
    if dtype == "auto":
        return dev, torch.bfloat16 if dev.type == "cuda" else torch.float32
    return dev, getattr(torch, dtype)


def load_adapter(cfg: LatencyConfig, device: torch.device, dtype: torch.dtype) -> VLMAdapter:
    """The reuse adapter of ``cfg.model`` (a random-weight timing model or a local checkpoint).

    Raises:
        ValueError: a timing model whose tokenizer directory has no ``tokenizer.json``.
    """
    if cfg.model in TIMING_MODELS:
        if not (Path(cfg.tokenizer) / "tokenizer.json").is_file():
            raise ValueError(f"tokenizer directory {str(cfg.tokenizer)!r} has no tokenizer.json "
                             "(expected the zoo tokenizer, e.g. zoo/smoke/tokenizer-<hash>)")
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(cfg.tokenizer, local_files_only=True)
        model, proc = build_timing_vlm(cfg.model, tok, device=device, dtype=dtype, seed=cfg.seed)
    else:
        model, proc = load_model(cfg.model, dtype=dtype, device=str(device))
    return adapter_for(model, proc)


@torch.no_grad()
def serve_full(adapter: VLMAdapter, record: dict) -> Served:
    """Full prefill of ``record``: encode, the model's own forward (``logits_to_keep=1``), argmax."""
    dev = adapter.device
    t0 = clock.now(dev)
    enc = encode_record(record, adapter.processor)
    inputs = {}
    for k in _FULL_INPUTS:
        if k in enc:
            v = enc[k].to(dev)
            inputs[k] = v.to(adapter.dtype) if v.is_floating_point() else v
    out = adapter.model(**inputs, use_cache=True, logits_to_keep=1)
    token = int(out.logits[0, -1].argmax())
    return Served(token=token, ttft_ms=(clock.now(dev) - t0) * 1e3)


def serve_cached(adapter: VLMAdapter, record: dict, images: list[ImageKV], policy: str | RefreshPolicy,
                 r: float) -> Served:
    """``record`` served from in-memory image caches under ``policy`` at ratio ``r``: assemble, refresh in place,
    argmax (``Served.req`` is then consumed: assemble again to rerun it)."""
    dev = adapter.device
    t0 = clock.now(dev)
    req = assemble(adapter, record, images)
    t1 = clock.now(dev)
    res = refresh(adapter, req, policy, r, in_place=True)
    token = int(res.output.logits.argmax())
    t2 = clock.now(dev)
    return Served(token=token, ttft_ms=(t2 - t0) * 1e3, assemble_ms=(t1 - t0) * 1e3, req=req, result=res)


def time_scoring(adapter: VLMAdapter, record: dict, images: list[ImageKV]) -> float:
    """Wall time (ms) of the scoring pass alone (in place, as served) on ``record`` assembled afresh (untimed)."""
    req = assemble(adapter, record, images)
    t0 = clock.now(adapter.device)
    scoring_pass(adapter, req, in_place=True)
    return (clock.now(adapter.device) - t0) * 1e3


def measure_flops(adapter: VLMAdapter, record: dict, images: list[ImageKV], method: str, r: float,
                  shape: flops.DecoderShape) -> dict[str, int]:
    """Measured and analytic FLOPs of one request under ``method`` (``flops*`` and ``refreshed_visual``
    columns of :data:`RAW_COLUMNS`)."""
    pol = table3_policy(method, r)
    if method == "full":
        _, fc = flops.count_flops(lambda: serve_full(adapter, record))
        req = assemble(adapter, record, images)
        ana = analytic_cost(pol, req, r, shape)
        return {"flops": fc.total, "flops_scoring": 0, "flops_vision": fc.under(".visual"),
                "flops_analytic": ana.total, "flops_analytic_scoring": 0, "refreshed_visual": ana.mean_visual_rows}
    served, fc = flops.count_flops(lambda: serve_cached(adapter, record, images, pol, r))
    fresh = assemble(adapter, record, images)
    fs = flops.count_flops(lambda: scoring_pass(adapter, fresh, in_place=True))[1].total if served.result.scoring else 0
    ana = analytic_cost(pol, served.req, r, shape)
    return {"flops": fc.total, "flops_scoring": fs, "flops_vision": 0,
            "flops_analytic": ana.total, "flops_analytic_scoring": ana.scoring, "refreshed_visual": ana.mean_visual_rows}


def _request_facts(req) -> dict[str, int]:
    return {"seq_len": req.seq_len, "n_visual": req.n_visual, "n_text": int(req.text_index.numel()),
            "n_query": int(req.query_index.numel())}


def run_conduit_latency(cfg: LatencyConfig, cache_dir: str | Path | None = None, log=print) -> list[dict]:
    """Run the Table 3 benchmark; returns one row per (size, method, repeat) with :data:`RAW_COLUMNS`.

    Args:
        cfg: the run (validated first).
        cache_dir: image-cache directory (default: a temporary one, removed afterwards).
        log: progress printer.

    Raises:
        ValueError: invalid ``cfg`` (before any model work).
    """
    cfg.validate()
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    device, dtype = resolve_device(cfg.device, cfg.dtype)
    methods = ["full"] + [m for m in dict.fromkeys(cfg.methods) if m != "full"]
    adapter = load_adapter(cfg, device, dtype)
    shape = flops.DecoderShape.of(adapter.model)
    log(f"model {cfg.model}: {n_params(adapter.model) / 1e6:.1f}M parameters "
        f"({n_params(adapter.model, 'model.language_model') / 1e6:.1f}M decoder), {device}, {dtype}, "
        f"{torch.get_num_threads()} threads")
    meta = {"model": cfg.model, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "page_px": cfg.page_px, "r": cfg.r}
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="kvbench-bench-") as tmp:
        for pages in cfg.sizes:
            record = bench_record(int(pages), cfg.page_px, cfg.seed)
            store = ImageKVStore(Path(cache_dir or tmp) / f"p{pages}", adapter, record["generic_system"])
            images = store.entries(record)
            facts = _request_facts(assemble(adapter, record, images))
            flop_cols = {m: measure_flops(adapter, record, images, m, cfg.r, shape) for m in methods}
            log(f"{pages} pages: {facts['seq_len']} tokens, {facts['n_visual']} visual")
            for rep in range(-cfg.warmup, cfg.repeats):
                for m in methods:
                    if m == "full":
                        s = serve_full(adapter, record)
                        scoring_ms = None
                    else:
                        s = serve_cached(adapter, record, images, table3_policy(m, cfg.r), cfg.r)
                        scoring_ms = time_scoring(adapter, record, images) if s.result.scoring is not None else None
                    if rep < 0:
                        continue
                    rows.append({**meta, "pages": int(pages), **facts, "method": m, "repeat": rep,
                                 "ttft_ms": s.ttft_ms, "assemble_ms": s.assemble_ms, "scoring_ms": scoring_ms,
                                 **flop_cols[m], "token": s.token})
            med = {m: sorted(x["ttft_ms"] for x in rows if x["pages"] == pages and x["method"] == m)
                   for m in methods}
            log("  " + ", ".join(f"{m} {v[len(v) // 2]:.0f} ms" for m, v in med.items()))
    return rows


def config_dict(cfg: LatencyConfig) -> dict:
    """``cfg`` as a plain dict (recorded next to the measurements)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items()}
