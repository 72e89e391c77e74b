"""The one command-line entry point: ``kvbench <verb> ...``.

Every Snakemake rule calls the package through these verbs, so no science
lives in the workflow files. Imports are lazy so ``kvbench --help`` is fast.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys

from kvbench.bench.settings import DEVICE_PATTERN


def _int_at_least(lo: int, what: str):
    """argparse type: an integer >= ``lo``, the error saying ``what`` was expected."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value
    return parse


_positive_int = _int_at_least(1, "a positive integer")  # thread counts, repeats
_nonneg_int = _int_at_least(0, "an integer >= 0")       # warm-up runs


def _device(text: str) -> str:
    """argparse type: ``auto``, ``cpu``, ``cuda`` or ``cuda:<i>`` (checked here, before any model work)."""
    if not re.fullmatch(DEVICE_PATTERN, text):
        raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:<index>, got {text!r}")
    return text


#: ``--dtype`` of the verbs that load a model or write a codec (torch dtype names; ``residualkv.train.DTYPES`` maps them).
FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def _words(values) -> str:
    """``values`` space-separated, as a list flag takes them (help texts)."""
    return " ".join(map(str, values))


def _tokenizer(a: argparse.Namespace) -> None:
    from kvbench.data.tokenizer import save_tokenizer

    print(json.dumps(save_tokenizer(a.out, vocab_size=a.vocab_size), indent=2))


def _data(a: argparse.Namespace) -> None:
    from kvbench.data.smoke import materialise

    meta = materialise(a.task, a.out, tokenizer_dir=a.tokenizer, seed=a.seed, n_train=a.n_train, n_test=a.n_test)
    print(json.dumps(meta, indent=2, default=str))


def _scbench_convert(a: argparse.Namespace) -> None:
    from kvbench.data.scbench import convert

    print(json.dumps(convert(a.task, a.src, a.out), indent=2))


def _json_object(text: str, flag: str) -> dict:
    """``text`` parsed as a JSON object (empty text: ``{}``); ValueError naming ``flag`` otherwise."""
    try:
        obj = json.loads(text) if text else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} must be a JSON object, got {text!r} ({e.msg})") from e
    if not isinstance(obj, dict):
        raise ValueError(f"{flag} must be a JSON object, got {text!r}")  # noqa: TRY004 (CLI reports ValueError)
    return obj


def _train(a: argparse.Namespace) -> None:
    from kvbench.eval.methods import full_cache_score
    from kvbench.train.zoo import train_zoo_model

    overrides = _json_object(a.overrides, "--overrides")
    floors = _json_object(a.floors, "--floors")
    summary = train_zoo_model(
        a.model, tokenizer_dir=a.tokenizer, out_dir=a.out, workdir=a.workdir,
        slice_s=a.slice_s or None, seed=a.seed, threads=a.threads, overrides=overrides,
        floors=floors, val_n=a.val_n, feeds=a.feeds, score=full_cache_score, warm_start=a.warm_start,
    )
    print(json.dumps(summary, indent=2, default=str))


def _codec_train(a: argparse.Namespace) -> None:
    import torch

    from kvbench.compress.residualkv.codec import ResidualCodec
    from kvbench.compress.residualkv.train import DTYPES, Placement, train_codec
    from kvbench.models.loader import load_model
    from kvbench.train.dist import init_world

    overrides = _json_object(a.overrides, "--overrides")
    if a.slice_s is not None and not a.slice_s >= 0:
        raise ValueError(f"--slice-s must be a number of seconds >= 0 (0: no slice), got {a.slice_s}")
    if not a.lr > 0:
        raise ValueError(f"--lr must be > 0, got {a.lr}")
    if a.data_files and a.data == "tasks":
        raise ValueError(f"--data-files is a text corpus or VLM records: it needs --data text or vlm, got --data {a.data}")
    if a.data == "vlm" and not a.data_files:
        raise ValueError("--data vlm trains on VLM record files: give them as --data-files (e.g. the tasks' train.jsonl)")
    if a.text_field != "text" and not a.data_files:
        raise ValueError(f"--text-field {a.text_field!r} names a column of --data-files, which are not given")
    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {a.device}: no CUDA device is visible (torch.cuda.is_available() is False)")
    place = Placement(device=a.device, dtype=a.dtype, grad_accum=a.grad_accum, checkpointing=a.checkpointing,
                      world=init_world(a.device))
    torch.manual_seed(a.seed)
    torch.set_num_threads(a.threads)
    model, tok = load_model(a.model, dtype=DTYPES[a.dtype], device=a.device)
    codec = ResidualCodec.for_model(model, seed=a.seed, **overrides)
    summary = train_codec(model, tok, codec, out_dir=a.out, objective=a.objective, steps=a.steps, seq_len=a.seq_len,
                          slice_s=a.slice_s or None, seed=a.seed, lr=a.lr, progress=True, data=a.data,
                          data_files=a.data_files, text_field=a.text_field, place=place)
    print(json.dumps(summary, indent=2, default=str))


def _codec_import(a: argparse.Namespace) -> None:
    from kvbench.compress.residualkv.deltakv_format import write_import
    from kvbench.models.loader import resolve_spec

    overrides = _json_object(a.overrides, "--overrides")
    model = resolve_spec(a.model) if a.model else None
    record = write_import(a.from_deltakv, a.out, model, **overrides)
    print(json.dumps(record, indent=2, default=str))


def _codec_export(a: argparse.Namespace) -> None:
    import torch

    from kvbench.compress.residualkv.codec import ResidualCodec
    from kvbench.compress.residualkv.deltakv_format import export_deltakv, saved_dtype
    from kvbench.models.loader import resolve_spec

    model = resolve_spec(a.model)
    dtype = getattr(torch, a.dtype) if a.dtype else saved_dtype(a.codec)
    out = export_deltakv(ResidualCodec.load(a.codec, model=None), a.out, model, dtype=dtype)
    print(json.dumps({"out": a.out, "dtype": str(dtype), "not_carried": out["not_carried"]}, indent=2))


#: ``kvbench eval`` flags a ``--from`` repeat takes from the run's config.yaml (given with it: refused)
FROM_RECORDED = ("model", "split", "method", "method_params", "seed", "limit")
#: files a repeat into another directory must reproduce byte for byte
REPEATED = ("predictions.jsonl", "metrics.json")


def _eval(a: argparse.Namespace) -> int:
    from pathlib import Path

    from kvbench.eval.runner import rerun, run_eval

    if a.from_dir is None:
        missing = [f"--{n}" for n in ("model", "split", "out") if getattr(a, n) is None]
        if missing:
            raise ValueError(f"the following arguments are required: {', '.join(missing)} (or --from DIR, to "
                             "repeat a recorded run)")
        params = _json_object(a.method_params or "", "--method-params")
        metrics = run_eval(a.model, a.split, method=a.method or "full", out_dir=a.out,
                           seed=0 if a.seed is None else a.seed, limit=a.limit, threads=a.threads or 1,
                           method_params=params)
        print(json.dumps(metrics, indent=2, default=str))
        return 0
    given = [f"--{n.replace('_', '-')}" for n in FROM_RECORDED if getattr(a, n) is not None]
    if given:
        raise ValueError(f"--from {a.from_dir} repeats the run recorded in its config.yaml, which sets "
                         f"{', '.join(given)}; only --out and --threads may be given with --from")
    metrics = rerun(a.from_dir, a.out, a.threads)
    print(json.dumps(metrics, indent=2, default=str))
    src, out = Path(a.from_dir), Path(a.out or a.from_dir)
    if out.resolve() == src.resolve():
        return 0
    differ = [f for f in REPEATED if not (src / f).is_file() or (src / f).read_bytes() != (out / f).read_bytes()]
    print(f"[kvbench eval] {', '.join(REPEATED)} of {out} vs {src}: "
          + (f"DIFFER ({', '.join(differ)})" if differ else "identical"), file=sys.stderr)
    return 1 if differ else 0


def _cache(a: argparse.Namespace) -> None:
    from kvbench.eval.refresh import build_caches
    from kvbench.utils.io import write_json

    compressed = None if a.compressed is None else json.loads(a.compressed)
    index = build_caches(a.model, a.split, a.cache_dir, limit=a.limit, threads=a.threads, compressed=compressed,
                         source_dir=a.source_dir)
    write_json(a.out, index)
    print(json.dumps({k: v for k, v in index.items() if k != "stores"}, indent=2))


def _diagnose(a: argparse.Namespace) -> None:
    from kvbench.eval.diagnose import diagnose_split

    df = diagnose_split(a.model, a.split, a.cache_dir, a.out, model_name=a.model_name, dataset=a.dataset, n=a.n,
                        m=a.m, seed=a.seed, threads=a.threads)
    print(json.dumps({"out": a.out, "records": int(df["record"].nunique()), "rows": len(df)}, indent=2))


def _replay(a: argparse.Namespace) -> int:
    from kvbench.eval.refresh import replay

    out = replay(a.run, a.id, cache_dir=a.cache_dir)
    print(json.dumps(out, indent=2))
    return 0 if out["match"] else 1


def _analyze(a: argparse.Namespace) -> None:
    """``kvbench analyze rkv-observations``: ResidualKV Fig. 3's data (:mod:`kvbench.report.residualkv.fig3`);
    ``kvbench analyze rkv-visual-case``: Fig. 13's (:mod:`kvbench.report.residualkv.fig13`)."""
    import torch

    from kvbench.compress.residualkv.observations import ReferenceSchedule, observe
    from kvbench.compress.residualkv.train import DTYPES
    from kvbench.models.loader import load_model
    from kvbench.report.residualkv import fig3 as rkv_fig3

    splits = {}
    for item in a.split:
        task, sep, path = item.partition("=")
        if not sep or not task or not path:
            raise ValueError(f"--split takes TASK=FILE (a task name and its JSONL split), got {item!r}")
        splits[task] = path
    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {a.device}: no CUDA device is visible (torch.cuda.is_available() is False)")
    torch.set_num_threads(a.threads)
    if a.what == "rkv-visual-case":
        _visual_case(a, splits, load_model(a.model, dtype=DTYPES[a.dtype], device=a.device))
        return
    given = [f"--{k.replace('_', '-')}" for k in ("method", "codec_dir", "layers") if getattr(a, k)]
    if given:
        raise ValueError(f"rkv-observations takes the schedule as --k/--stride/...; {given} are rkv-visual-case's")
    schedule = ReferenceSchedule(k=a.k, n_sink=a.n_sink, stride=a.stride, alpha=a.alpha, grid=a.grid, block=a.block)
    model, proc = load_model(a.model, dtype=DTYPES[a.dtype], device=a.device)
    obs = observe(model, proc, splits, schedule, records_per_task=a.records_per_task, max_tokens=a.max_tokens,
                  context_tokens=a.context_tokens, model_name=a.model_name or str(a.model))
    df = rkv_fig3.write(obs, a.out, a.profile, a.zoo)
    s = df[(df["panel"] == "summary") & (df["layer"] == "all") & (df["series"] == "raw")].set_index("quantity")["value"]
    print(json.dumps({"out": a.out, "contexts": len(obs.contexts), "tokens": obs.n_tokens, "layers": len(obs.layers),
                      **{k: round(float(v), 4) for k, v in s.items()}}, indent=2))


def _visual_case(a: argparse.Namespace, splits: dict, loaded: tuple) -> None:
    """``kvbench analyze rkv-visual-case``: one record of one split through the VLM, its visual tokens' references
    as the ResidualKV press ``--method`` with the codec ``--codec-dir`` stores them (Fig. 13's CSV)."""
    from pathlib import Path

    from kvbench.compress.residualkv.cache import ResidualKVPress
    from kvbench.compress.residualkv.visual_case import StoreSchedule, visual_case
    from kvbench.report.residualkv import fig13 as rkv_fig13
    from kvbench.plan.residualkv import press_spec
    from kvbench.utils.io import read_jsonl

    if len(splits) != 1:
        raise ValueError(f"rkv-visual-case reads one record of one split: give one --split TASK=FILE, got {len(splits)}")
    if not a.method or not a.codec_dir or not a.layers:
        raise ValueError("rkv-visual-case needs --method (the ResidualKV row's spec), --codec-dir (its trained codec) "
                         "and --layers (decoder layers to draw)")
    spec = press_spec(a.method)
    if not issubclass(spec.cls, ResidualKVPress):
        raise ValueError(f"--method {a.method!r} is not a ResidualKV press (residualkv[+selector]): it stores no references")
    press = spec.build(codec_dir=a.codec_dir)
    press.load()
    (task, path), = splits.items()
    records = read_jsonl(path)
    if not 0 <= a.record < len(records):
        raise ValueError(f"--record {a.record}: {path} holds {len(records)} record(s) (0..{len(records) - 1})")
    model, proc = loaded
    case = visual_case(model, proc, records[a.record], Path(path).parent, StoreSchedule.of_press(press), a.layers,
                       image=a.image, task=task, model_name=a.model_name or str(a.model))
    df = rkv_fig13.write(case, a.out, a.profile, a.zoo)
    s = rkv_fig13.summary_frame(df).set_index("layer")
    print(json.dumps({"out": a.out, "record": case.record, "image": case.image, "grid": case.grids[case.image],
                      "tokens": case.n_tokens, **{f"layer {k}": {"share_patch": round(float(v["share_patch"]), 4),
                                                                 "chance_patch": round(float(v["chance_patch"]), 4)}
                                                  for k, v in s.iterrows()}}, indent=2))


#: Figure targets of ``kvbench report`` (each writes a PDF); the help text and the ``--out`` check read this list.
REPORT_FIGURES = ("zoo-figure", "conduit-fig3", "conduit-fig4",
                  *(f"residualkv-fig{n}" for n in (3, 5, 6, 8, 10, 11, 12, 13)))


class _ReportHelp(argparse.HelpFormatter):
    """``kvbench report -h``: ``{tables}`` in a help text becomes the names of the table registry
    (:data:`kvbench.report.tables.TABLES`), imported only when the help is shown (it loads torch)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if "{tables}" not in (action.help or ""):
            return action.help
        from kvbench.report.tables import TABLES

        papers = list(dict.fromkeys(name.split("/")[0] for name in TABLES))  # registry order: CONDUIT first

        def key(name: str) -> tuple:
            paper, _, rest = name.partition("/")
            return papers.index(paper), [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", rest)]

        return action.help.replace("{tables}", ", ".join(sorted(TABLES, key=key)))


def _report(a: argparse.Namespace) -> None:
    from kvbench.report import zoo

    figures = set(REPORT_FIGURES)
    if a.what in figures and not str(a.out).endswith(".pdf"):
        raise ValueError(f"--out of {a.what} must end in .pdf, got {a.out!r}")
    if a.what in ("compare", "compare-page"):  # ours beside the published figures (kvbench.report.compare)
        from pathlib import Path

        from kvbench.report import compare

        if a.what == "compare":
            if not a.table:
                raise ValueError("compare needs --table (a built table, results/<paper>/<table>.csv)")
            name = a.name or None
            paper = (name or f"{Path(a.table).parent.name}/").split("/", 1)[0]
            published = a.published or str(Path("config", "published", f"{paper}.yaml"))
            compare.compare(a.table, published, a.out, name=name)
        else:
            compare.page(a.compare, a.out)
        return
    if "/" in a.what:  # a table target, e.g. conduit/table1 (kvbench.report.tables)
        from kvbench.report import tables

        if not a.spec:
            raise ValueError(f"table {a.what} needs --spec (the workflow's JSON: profile and the paper's "
                             "config section)")
        spec = _json_object(a.spec, "--spec")
        if a.allow_missing:
            spec["allow_missing"] = True
        tables.write(a.what, spec, a.out)
    elif a.what.startswith("residualkv-"):
        from kvbench.report.residualkv import figures as rkv_figures
        from kvbench.report.residualkv import figure_entry as rkv_report

        what = a.what.removeprefix("residualkv-")
        if what == "fig3":  # the observations' CSV (kvbench analyze rkv-observations) -> PDF + headline summary
            from kvbench.report.residualkv import fig3 as rkv_fig3

            if not a.raw or not a.data_out:
                raise ValueError(f"{a.what} needs --raw (fig3.csv of `kvbench analyze rkv-observations`) and "
                                 "--data-out (the headline summary CSV)")
            rkv_fig3.plot(a.raw, a.out, a.data_out, published=a.published)
            return
        if what == "fig13":  # the visual case's CSV (kvbench analyze rkv-visual-case) + its split -> PDF + summary
            from kvbench.report.residualkv import fig13 as rkv_fig13

            if not a.raw or not a.data_out or not a.split:
                raise ValueError(f"{a.what} needs --raw (fig13.csv of `kvbench analyze rkv-visual-case`), --split (the "
                                 "JSONL split its record is from: the image drawn) and --data-out (the summary CSV)")
            rkv_fig13.plot(a.raw, a.split, a.out, a.data_out, queries=a.queries)
            return
        if what in ("fig8", "fig6"):
            if not a.raw:
                raise ValueError(f"{a.what} needs --raw (the profiling CSV)")
            for flag in ("residualkv", "data_out"):
                if getattr(a, flag):  # fig6/fig8 plot the profiling CSV alone; a flag that does nothing is an error
                    raise ValueError(f"{a.what} reads only --raw (the profiling CSV); --{flag.replace('_', '-')} "
                                     f"is not used")
            getattr(rkv_figures, what)(a.raw, a.out)
            return
        if not a.residualkv:
            raise ValueError(f"{a.what} needs --residualkv (JSON: profile, residualkv config section)")
        if what.startswith("fig") and not a.data_out:
            raise ValueError(f"{a.what} needs --data-out (CSV of the plotted numbers)")
        rkv_report.report(what, _json_object(a.residualkv, "--residualkv"), a.out, out_csv=a.data_out, raw=a.raw)
    elif a.what == "zoo":
        zoo.write_zoo_table(a.runs, a.train, a.out, timing_csv=a.timing_out)
    elif a.what == "zoo-figure":
        zoo.plot_training_curves(a.train, a.out)
    elif a.what in ("conduit-fig3", "conduit-fig4"):
        from kvbench.report.conduit import accuracy as conduit

        if not a.conduit:
            raise ValueError(f"{a.what} needs --conduit (JSON: profile, conduit config section, splits)")
        if not a.data_out:
            raise ValueError(f"{a.what} needs --data-out (CSV of the plotted numbers)")
        spec = _json_object(a.conduit, "--conduit")
        if a.allow_missing:
            spec["allow_missing"] = True
        (conduit.report_fig3 if a.what == "conduit-fig3" else conduit.report_fig4)(spec, a.out, a.data_out)
    else:
        raise ValueError(f"unknown report {a.what!r}; expected a table (conduit/table1, residualkv/tableIII, ...: "
                         f"kvbench.report.tables), zoo, or a figure {sorted(figures)}")


def _bench_rkv(a: argparse.Namespace) -> None:
    """A ResidualKV profiling verb: its settings from the flags (a flag left unset keeps the default of
    :mod:`kvbench.bench.settings`), checked before any model work, then measured into one CSV."""
    from kvbench.bench import codec_cost, codec_variants, decode
    from kvbench.bench.settings import BY_VERB

    cls = BY_VERB[a.what]
    s = cls(**{f.name: getattr(a, f.name) for f in dataclasses.fields(cls) if getattr(a, f.name) is not None})
    timing = {"repeats": s.repeats, "threads": s.threads, "device": s.device, "dtype": s.dtype, "seed": s.seed}
    if a.what == "rkv-variants":
        if not a.codecs or not a.default:
            raise ValueError("rkv-variants needs --codecs LABEL=DIR ... and --default LABEL")
        rows, header = codec_variants.measure_variant_throughput(
            codec_variants.parse_codec_dirs(a.codecs), a.default, s.model, s.contexts[0], decode_steps=s.decode_steps,
            warmup_steps=s.warmup, tokenizer=s.tokenizer, log=print, **timing)
        columns = codec_variants.COLUMNS
    elif a.what == "codec-cost":
        rows, header = codec_cost.measure_codec_cost(
            *s.codec_shape, tokens=s.tokens, restore_tokens=s.restore_tokens, decode_steps=s.decode_steps,
            warmup=s.warmup, **timing)
        columns = codec_cost.COLUMNS
    else:
        # the CSV is rewritten after each context, so a failure at a long one keeps the shorter ones
        rows, header = decode.measure_decode_throughput(
            s.model, s.contexts, s.methods, decode_steps=s.decode_steps, warmup_steps=s.warmup,
            codec_dir=s.codec_dir, tokenizer=s.tokenizer, prefill_chunk=s.prefill_chunk, log=print,
            on_context=lambda part, head: decode.write_csv(part, head, decode.COLUMNS, a.out), **timing)
        columns = decode.COLUMNS
    decode.write_csv(rows, header, columns, a.out)
    print(header)


#: ``kvbench bench`` flags each verb reads (the parser is shared; a flag given to a verb that does not read it is refused)
_TIMING_FLAGS = ("repeats", "warmup", "threads", "device", "dtype", "seed")
BENCH_FLAGS = {
    "conduit-latency": ("model", "tokenizer", "sizes", "page_px", "r", "methods", *_TIMING_FLAGS),
    "rkv-throughput": ("model", "tokenizer", "methods", "contexts", "decode_steps", "codec_dir", "prefill_chunk",
                       *_TIMING_FLAGS),
    "rkv-variants": ("model", "tokenizer", "contexts", "decode_steps", "codecs", "default", *_TIMING_FLAGS),
    "codec-cost": ("codec_shape", "tokens", "restore_tokens", "decode_steps", *_TIMING_FLAGS),
}
#: flags with a non-None parser default (always set)
_ALWAYS_SET = ("device", "dtype", "seed")


def _check_bench_flags(a: argparse.Namespace) -> None:
    """Raise ValueError naming a flag given to a ``bench`` verb that does not read it (it would be ignored)."""
    given = {f for flags in BENCH_FLAGS.values() for f in flags
             if f not in _ALWAYS_SET and getattr(a, f, None) is not None}
    stray = sorted(given - set(BENCH_FLAGS[a.what]))
    if stray:
        owners = {f: [v for v, flags in BENCH_FLAGS.items() if f in flags] for f in stray}
        raise ValueError("; ".join(f"--{f.replace('_', '-')} is not read by `bench {a.what}` (it is for: "
                                   f"{', '.join(owners[f])})" for f in stray))


def _bench(a: argparse.Namespace) -> None:
    _check_bench_flags(a)
    if a.what in ("rkv-throughput", "rkv-variants", "codec-cost"):
        _bench_rkv(a)
        return
    from kvbench.bench import BENCH_DEFAULTS as d

    for name in ("model", "methods", "repeats", "warmup", "sizes", "page_px", "r"):   # None: the verb's own default
        if getattr(a, name) is None:
            setattr(a, name, d[name])
    import pandas as pd

    from kvbench.bench.latency import RAW_COLUMNS, LatencyConfig, run_conduit_latency
    from kvbench.utils.io import atomic_path

    cfg = LatencyConfig(model=a.model, tokenizer=a.tokenizer, sizes=a.sizes, page_px=a.page_px, r=a.r,
                        methods=a.methods, repeats=a.repeats, warmup=a.warmup, threads=a.threads,
                        device=a.device, dtype=a.dtype, seed=a.seed)
    rows = run_conduit_latency(cfg)
    with atomic_path(a.out) as tmp:
        pd.DataFrame(rows, columns=RAW_COLUMNS).to_csv(tmp, index=False)


def _parity(a: argparse.Namespace) -> None:
    if a.what == "prepare":
        from kvbench.bench.parity import prepare

        prepare(a.workdir, threads=a.threads)
        return
    from pathlib import Path

    from kvbench.report.parity import summary, write_parity_csv

    if not a.out:
        raise ValueError("parity compare needs --out")
    w = Path(a.workdir)
    table = write_parity_csv(w / "plan.json", w / "kvbench.json", w / "kvpress.json", a.out)
    print(summary(table).to_string())


def build_parser() -> argparse.ArgumentParser:
    """The ``kvbench`` argument parser (one sub-command per pipeline verb)."""
    p = argparse.ArgumentParser(prog="kvbench", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="verb", required=True)

    s = sub.add_parser("tokenizer", help="train and save the tiny zoo's offline BPE tokenizer")
    s.add_argument("--out", required=True, help="output directory (save_pretrained layout)")
    s.add_argument("--vocab-size", type=int, default=4096)
    s.set_defaults(func=_tokenizer)

    s = sub.add_parser("data", help="materialise one smoke benchmark to <out>/{train,test}.jsonl (+ images/)")
    s.add_argument("--task", required=True, help="smoke task name, e.g. docpages, digitgrid, niah_1k, kv_2k, vt_4k, lcc")
    s.add_argument("--tokenizer", required=True, help="tokenizer directory (token lengths are measured with it)")
    s.add_argument("--out", required=True)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--n-train", type=int, default=256)
    s.add_argument("--n-test", type=int, default=200)
    s.set_defaults(func=_data)

    s = sub.add_parser("scbench-convert", help="one of SCBench's task files -> multi-query records (ResidualKV "
                       "Table IV on the paper profile; kvbench.data.scbench)")
    s.add_argument("--task", required=True, help="SCBench task, e.g. scbench_kv, scbench_qa_eng")
    s.add_argument("--src", required=True, help="SCBench's JSONL of that task (data/<task>.jsonl)")
    s.add_argument("--out", required=True, help="output JSONL")
    s.set_defaults(func=_scbench_convert)

    s = sub.add_parser("train", help="train one tiny zoo model on the CPU (resumable)")
    s.add_argument("--model", required=True, help="zoo model name, e.g. tiny-qwen2-lm or tiny-qwen2.5-vl")
    s.add_argument("--tokenizer", required=True)
    s.add_argument("--out", required=True, help="final checkpoint directory (HF save_pretrained layout)")
    s.add_argument("--workdir", required=True, help="resumable training state, loss curves")
    s.add_argument("--slice-s", type=float, default=None,
                   help="end this invocation after this many wall-clock seconds (state saved, exit 3); "
                        "rerunning resumes. Training always runs every step of the recipe (default, or 0: no slice)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--threads", type=_positive_int, default=2)
    s.add_argument("--overrides", default="", help="JSON object of training-recipe overrides")
    s.add_argument("--floors", default="", help="JSON object: smoke task -> minimum validation score in [0, 1]")
    s.add_argument("--val-n", type=_positive_int, default=100, help="validation records per floored task")
    s.add_argument("--feeds", default="", help="the targets this model feeds (named when a floor fails)")
    s.add_argument("--warm-start", default=None,
                   help="a seed replica <entry>-s<k>: its entry's kept warm-up state (<entry workdir>/warmup); "
                        "training starts after the phases they share")
    s.set_defaults(func=_train)

    s = sub.add_parser("codec-train", help="train a ResidualKV codec on a frozen LM (resumable; ResidualKV §IV-D)")
    s.add_argument("--model", required=True, help="HF checkpoint directory or zoo name (the frozen backbone)")
    s.add_argument("--out", required=True, help="work directory: state/, then codec/, curves.csv, summary.json (+ *.timing.*)")
    s.add_argument("--overrides", default="", help="JSON object of CodecConfig fields, e.g. '{\"d_c\": 32, \"stride\": 10}'")
    s.add_argument("--objective", default="joint", choices=["joint", "ntp", "mse"],
                   help="joint = next-token CE + reconstruction MSE (paper); ntp / mse: Fig. 12 variants")
    s.add_argument("--steps", type=_positive_int, required=True, help="optimiser steps (one packed window each)")
    s.add_argument("--seq-len", type=_positive_int, default=512, help="tokens per packed training window")
    s.add_argument("--slice-s", type=float, default=None, metavar="SECONDS",
                   help="wall-clock slice of this invocation: when it ends before --steps, the state is saved and "
                        "the command fails (exit 3) saying how many steps are done; rerunning resumes. The codec "
                        "and summary.json are written only when all steps are done (default, or 0: no slice)")
    s.add_argument("--lr", type=float, default=2e-4, help="AdamW peak learning rate (paper §V-A: 2e-4)")
    s.add_argument("--data", default="text", choices=["text", "tasks", "vlm", "chain"],
                   help="text: packed corpus windows (the paper's kind of data); tasks: the zoo LM's own task mixture; "
                        "vlm: a VLM's image records (--data-files: JSONL in the benchmark record format); "
                        "chain: the chain task of Table V's zoo backbone")
    s.add_argument("--data-files", nargs="+", default=None, metavar="FILE",
                   help="with --data text: a local corpus (.jsonl/.json/.parquet with a text column, or .txt lines; "
                        "the paper's FineWeb-Edu in that layout) instead of the bundled one; 1%% of its documents "
                        "(by index hash) are held out for the validation windows; with --data vlm: JSONL files of "
                        "VLM records (1 in 10 records, by id hash, held out)")
    s.add_argument("--text-field", default="text", help="the corpus files' text column (default: text)")
    s.add_argument("--device", type=_device, default="cpu",
                   help="torch device of the backbone and codec: cpu, cuda, cuda:1, auto (under torchrun: each "
                        "process takes the GPU of its LOCAL_RANK)")
    s.add_argument("--dtype", default="float32", choices=FLOAT_DTYPES,
                   help="backbone dtype; bfloat16/float16 run both passes under autocast, the codec keeps float32 "
                        "weights (the authors: bf16)")
    s.add_argument("--grad-accum", type=_positive_int, default=1,
                   help="sequences each process accumulates per optimiser step (global batch = this x processes)")
    s.add_argument("--checkpointing", action="store_true",
                   help="activation checkpointing of the decoder layers in the compressed pass (memory for time)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--threads", type=_positive_int, default=1)
    s.set_defaults(func=_codec_train)

    s = sub.add_parser("codec-import", help="a ResidualKV (DeltaKV) authors' compressor checkpoint -> a codec "
                                            "directory (codec.safetensors, codec.json, provenance.json)")
    s.add_argument("--from-deltakv", required=True, metavar="DIR",
                   help="their compressor directory: config.json + model.safetensors (pickle weights are refused)")
    s.add_argument("--out", required=True, help="codec directory to write")
    s.add_argument("--model", default=None, help="target backbone (checkpoint directory or zoo name) its shapes are "
                                                 "checked against (default: the checkpoint's own config.json)")
    s.add_argument("--overrides", default="", help="JSON object of inference-time CodecConfig fields (k, stride, "
                                                   "alpha, n_sink, window, bits, group, grid); structural ones must "
                                                   "equal the checkpoint's")
    s.set_defaults(func=_codec_import)

    s = sub.add_parser("codec-export", help="a codec directory -> the ResidualKV authors' compressor layout "
                                            "(model.safetensors + config.json)")
    s.add_argument("--codec", required=True, help="codec directory (codec.safetensors, codec.json)")
    s.add_argument("--model", required=True, help="the backbone (checkpoint directory or zoo name): its config.json "
                                                  "is the base of the written one")
    s.add_argument("--out", required=True, help="directory to write")
    s.add_argument("--dtype", default=None, choices=FLOAT_DTYPES,
                   help="dtype of the written tensors (default: the one codec.safetensors stores)")
    s.set_defaults(func=_codec_export)

    s = sub.add_parser("eval", help="run a method over a benchmark split (or repeat a run: --from DIR)")
    s.add_argument("--model", default=None, help="HF checkpoint directory or zoo name (required without --from)")
    s.add_argument("--split", default=None, help="JSONL split file (required without --from)")
    s.add_argument("--method", default=None,
                   help="'full' (model.generate), a CONDUIT spec such as reuse, conduit@0.1, conduit@0.1:lam=0.5, "
                        "prophetkv@0.05, mpic-first@0.1, or a compression press spec such as fullkv, snapkv:keep=0.3, "
                        "kivi:bits=2, residualkv+omnikv:full_layers=0+1,keep=0.2 (needs --method-params '{\"codec_dir\": ...}') "
                        "(default: full)")
    s.add_argument("--out", default=None, help="run directory: predictions.jsonl, metrics.json, timing.csv, config.yaml, "
                                               "run_info.json (an unfinished run there with the same arguments resumes); "
                                               "required without --from, with it default: the --from directory, which "
                                               "then must be an unfinished run (it resumes); a finished one is refused)")
    s.add_argument("--from", dest="from_dir", default=None, metavar="DIR",
                   help="repeat the run recorded in DIR/config.yaml from that file alone, after checking the SHA-256 "
                        "of the files it names (split, checkpoint, codec); only --out and --threads may be given with "
                        "it. Into another --out: exit 1 unless predictions.jsonl and metrics.json are byte-identical")
    s.add_argument("--seed", type=int, default=None, help="run seed (default: 0)")
    s.add_argument("--limit", type=int, default=None, help="evaluate only the first N samples")
    s.add_argument("--threads", type=_positive_int, default=None,
                   help="torch threads (default: 1; with --from, the recorded count)")
    s.add_argument("--method-params", default=None,
                   help="JSON object of method parameters, e.g. '{\"cache_dir\": \"cache/x\", \"build_missing\": false}'")
    s.set_defaults(func=_eval)

    s = sub.add_parser("cache", help="build the reusable per-image KV caches of a split (CONDUIT refresh runs)")
    s.add_argument("--model", required=True, help="HF checkpoint directory or zoo name (a VLM)")
    s.add_argument("--split", required=True, help="JSONL split of VLM records with generic_system")
    s.add_argument("--cache-dir", required=True, help="cache root (one store per model weights and generic prefix)")
    s.add_argument("--out", required=True, help="index JSON written last (what was built or reused)")
    s.add_argument("--limit", type=int, default=None, help="only the first N records")
    s.add_argument("--threads", type=_positive_int, default=1)
    s.add_argument("--compressed", default=None,
                   help="JSON CacheCodec spec (codec_dir, full_layers, full_kv_bits, bits, n_sink): store the caches "
                        "in ResidualKV's form, coded from the raw caches under --source-dir")
    s.add_argument("--source-dir", default=None, help="raw cache root the compressed entries are coded from")
    s.set_defaults(func=_cache)

    s = sub.add_parser("conduit-diagnose", help="capture CONDUIT's premise diagnostics over a split (Tables 11-13; "
                                                "reads the image caches of `kvbench cache`)")
    s.add_argument("--model", required=True, help="HF checkpoint directory or zoo name (a VLM)")
    s.add_argument("--model-name", required=True, help="the config's name of the model (written into each row)")
    s.add_argument("--dataset", required=True, help="the config's name of the dataset (written into each row)")
    s.add_argument("--split", required=True, help="JSONL split of VLM records with generic_system")
    s.add_argument("--cache-dir", required=True, help="image-cache root built by `kvbench cache` (read-only)")
    s.add_argument("--out", required=True, help="capture CSV (written atomically)")
    s.add_argument("--n", type=_positive_int, default=16, help="records captured (the first N)")
    s.add_argument("--m", type=_positive_int, default=5, help="Monte Carlo directions per token (paper: 5)")
    s.add_argument("--seed", type=int, default=0, help="seed of the Monte Carlo directions")
    s.add_argument("--threads", type=_positive_int, default=1)
    s.set_defaults(func=_diagnose)

    s = sub.add_parser("replay", help="re-run the recorded refresh plan of one sample and compare the prediction")
    s.add_argument("--run", required=True, help="run directory of a refresh method (predictions.jsonl with plans)")
    s.add_argument("--id", required=True, help="record id")
    s.add_argument("--cache-dir", default=None, help="image cache root when the run's is gone (default: rebuild)")
    s.set_defaults(func=_replay)

    s = sub.add_parser("report", help="tables and figures from finished runs", formatter_class=_ReportHelp)
    s.add_argument("what", help="a table target ({tables}: kvbench.report.tables), zoo, a figure "
                   f"({', '.join(REPORT_FIGURES)}), compare (a table beside the "
                   "published figures: --table, [--published], --out <table>.compare.csv) or compare-page (--compare "
                   "CSVs, --out results/compare.md)")
    s.add_argument("--runs", nargs="*", default=[], help="run directories (eval outputs)")
    s.add_argument("--train", nargs="*", default=[], help="training work directories (curves, summary)")
    s.add_argument("--spec", default="", help="tables: the workflow's JSON (profile and the paper's config section)")
    s.add_argument("--conduit", default="",
                   help="conduit-fig3, conduit-fig4: JSON {profile, conduit: config section, splits, zoo_models}")
    s.add_argument("--data-out", default=None, help="conduit-fig3, conduit-fig4, residualkv-fig{5,10,11,12}: CSV of the plotted numbers; "
                   "residualkv-fig3: the headline summary CSV")
    s.add_argument("--residualkv", default="", help="residualkv-*: JSON {profile, residualkv: config section}")
    s.add_argument("--raw", default=None, help="residualkv-fig8 / -fig6: the profiling CSV to plot; residualkv-fig3: fig3.csv; "
                   "residualkv-fig11: the `bench rkv-variants` CSV (throughput panel)")
    s.add_argument("--timing-out", default=None, help="zoo: CSV of the training wall-clock times (kept out of the table)")
    s.add_argument("--allow-missing", action="store_true",
                   help="CONDUIT tables and conduit-fig3: a missing run gives empty cells with a note naming it "
                        "(default: error)")
    s.add_argument("--table", default=None, help="compare: the built table (results/<paper>/<table>.csv)")
    s.add_argument("--name", default=None, help="compare: <paper>/<table> when --table is not results/<paper>/<table>.csv")
    s.add_argument("--published", default=None,
                   help="compare: the published figures (default config/published/<paper>.yaml); residualkv-fig3: "
                        "the file whose fig3 entries the summary sets beside ours (none: no published column)")
    s.add_argument("--compare", nargs="*", default=[], help="compare-page: the compare CSVs to summarise")
    s.add_argument("--split", default=None, help="residualkv-fig13: the JSONL split of fig13.csv's record (its image)")
    s.add_argument("--queries", type=_positive_int, default=4,
                   help="residualkv-fig13: query patches drawn with their references (evenly spaced)")
    s.add_argument("--out", required=True)
    s.set_defaults(func=_report)

    s = sub.add_parser("analyze", help="analyses of a model's KV cache: rkv-observations (ResidualKV Fig. 3's data: "
                                        "max cosine to earlier tokens, match distance, raw vs reference residuals), "
                                        "rkv-visual-case (Fig. 13's: the references of one image's visual tokens)")
    s.add_argument("what", choices=["rkv-observations", "rkv-visual-case"])
    s.add_argument("--model", required=True, help="HF checkpoint directory or zoo name (rkv-observations: an LM, a VLM runs text only; "
                   "rkv-visual-case: a VLM)")
    s.add_argument("--model-name", default="", help="the config's name of the model (in the CSV header)")
    s.add_argument("--split", nargs="+", required=True, metavar="TASK=FILE",
                   help="rkv-observations: JSONL test splits of text records (context + question), their contexts "
                        "analysed; rkv-visual-case: one split of VLM records")
    s.add_argument("--out", required=True, help="the CSV, written atomically (rkv-observations: every panel, "
                   "kvbench.report.residualkv.fig3; rkv-visual-case: kvbench.report.residualkv.fig13)")
    s.add_argument("--profile", default="adhoc", help="profile name for the CSV header")
    s.add_argument("--zoo", action="store_true", help="the model is the tiny zoo LM (the header says so)")
    s.add_argument("--records-per-task", type=_positive_int, default=2, help="contexts per split (its first records)")
    s.add_argument("--max-tokens", type=_int_at_least(2, "an integer >= 2"), default=4096,
                   help="tokens analysed in all (the last context is truncated)")
    s.add_argument("--context-tokens", type=_int_at_least(2, "an integer >= 2"), default=None,
                   help="at most this many tokens of each context (default: whole contexts)")
    s.add_argument("--k", type=_positive_int, default=4, help="references averaged per token (main codec's k)")
    s.add_argument("--n-sink", type=_nonneg_int, default=8, help="sink tokens (main codec's n_sink)")
    s.add_argument("--stride", type=_positive_int, default=10, help="reference stride (main codec's stride)")
    s.add_argument("--alpha", type=float, default=0.0, help="dynamic-stride growth (main codec's alpha)")
    s.add_argument("--grid", choices=["paper", "code"], default="paper", help="reference grid (main codec's grid)")
    s.add_argument("--block", type=_positive_int, default=128, help="the code grid's block (main codec's window)")
    s.add_argument("--device", type=_device, default="auto", help="auto (CUDA if available), cpu or cuda[:i]")
    s.add_argument("--dtype", default="float32", choices=FLOAT_DTYPES, help="model dtype")
    s.add_argument("--threads", type=_positive_int, default=1)
    s.add_argument("--record", type=_nonneg_int, default=0, help="rkv-visual-case: the record (0-based index in --split)")
    s.add_argument("--image", type=_nonneg_int, default=0, help="rkv-visual-case: which of its images is drawn (0-based)")
    s.add_argument("--layers", type=_nonneg_int, nargs="+", default=None,
                   help="rkv-visual-case: decoder layers analysed (sparse layers of --method)")
    s.add_argument("--method", default=None, help="rkv-visual-case: the ResidualKV press spec whose storage is drawn "
                   "(Table II's ResidualKV row: its full layers, ref_fp8, alpha/stride overrides)")
    s.add_argument("--codec-dir", default=None, help="rkv-visual-case: the press's trained codec (codec.json: k, n_sink, "
                   "stride, alpha, grid)")
    s.set_defaults(func=_analyze)

    s = sub.add_parser("parity", help="parity with NVIDIA's kvpress (results/parity/kvpress.csv): prepare = the tiny "
                                       "model, contexts, mapped parameters and kvbench's kept sets; compare = the CSV "
                                       "from both sides (kvpress's written by scripts/parity_kvpress.py)")
    s.add_argument("what", choices=["prepare", "compare"])
    s.add_argument("--workdir", required=True, help="model/, plan.json, kvbench.json (prepare writes), kvpress.json")
    s.add_argument("--out", default=None, help="compare: the CSV")
    s.add_argument("--threads", type=_positive_int, default=1)
    s.set_defaults(func=_parity)

    from kvbench.bench import BENCH_DEFAULTS as d  # light modules: defaults only
    from kvbench.bench import DTYPES as d_dtypes
    from kvbench.bench import settings as rkv

    fig8, fig6, fig11 = rkv.DecodeThroughputConfig, rkv.CodecCostConfig, rkv.VariantThroughputConfig

    s = sub.add_parser("bench", help="latency benchmarks: conduit-latency (raw TTFT/FLOPs CSV; Table 3 is "
                                      "`kvbench report conduit/table3`), "
                                      "rkv-throughput (ResidualKV Fig. 8), rkv-variants (Fig. 11's throughput), "
                                      "codec-cost (ResidualKV Fig. 6)")
    s.add_argument("what", choices=list(BENCH_FLAGS))
    s.add_argument("--out", required=True, help="raw measurements CSV")
    s.add_argument("--model", default=None, help=f"timing model name (random weights) or checkpoint dir "
                   f"(default: {d['model']}; rkv-throughput: {fig8.model})")
    s.add_argument("--tokenizer", default=None, help="tokenizer directory (timing models; rkv-throughput: the zoo's "
                   f"{fig8.tokenizer}, for its vocabulary size)")
    s.add_argument("--sizes", type=int, nargs="+", default=None,
                   help=f"conduit-latency: pages per request, one context each (default {_words(d['sizes'])})")
    s.add_argument("--page-px", type=int, default=None,
                   help=f"conduit-latency: page side in px (multiple of 28, <= 448; default {d['page_px']})")
    s.add_argument("--r", type=float, default=None,
                   help=f"conduit-latency: refresh ratio of the budgeted methods (default {d['r']})")
    s.add_argument("--methods", nargs="+", default=None, help="conduit-latency: refresh policies, each <policy> or "
                   "<policy>:key=value,... without a budget, e.g. conduit:phase2_text=query (full is always added); "
                   f"rkv-throughput: {', '.join(rkv.METHODS)} (default: all)")
    s.add_argument("--repeats", type=_positive_int, default=None,
                   help=f"timed runs per (size, method) (default: {d['repeats']}; rkv-throughput {fig8.repeats}, "
                        f"codec-cost {fig6.repeats})")
    s.add_argument("--warmup", type=_nonneg_int, default=None,
                   help=f"untimed runs first (default: {d['warmup']}; rkv-throughput: {fig8.warmup} decode steps, "
                        f"codec-cost {fig6.warmup})")
    s.add_argument("--threads", type=_positive_int, default=None, help="torch threads (default: torch's)")
    s.add_argument("--device", type=_device, default="auto", help="auto (CUDA if available), cpu or cuda[:i]")
    s.add_argument("--dtype", choices=d_dtypes, default="auto", help="auto (bfloat16 on CUDA, float32 on CPU) or a torch dtype")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--contexts", type=_positive_int, nargs="+", default=None,
                   help=f"rkv-throughput: context lengths in tokens (default {_words(fig8.contexts)}, for a CPU; "
                        f"the paper's range on a GPU: {_words(rkv.PAPER_CONTEXTS)}); rkv-variants: one context "
                        f"(default {_words(fig11.contexts)})")
    s.add_argument("--decode-steps", type=_positive_int, default=None,
                   help=f"rkv-throughput: timed greedy steps per run (default {fig8.decode_steps}); codec-cost: "
                        f"restores in the total (default {fig6.decode_steps})")
    s.add_argument("--codec-dir", default=None, help="rkv-throughput: a trained codec (default: a random one)")
    s.add_argument("--prefill-chunk", type=_positive_int, default=None,
                   help=f"rkv-throughput: tokens per untimed prefill forward (default {fig8.prefill_chunk}; "
                        "smaller bounds the memory of long contexts)")
    s.add_argument("--codecs", nargs="+", default=None, metavar="LABEL=DIR",
                   help="rkv-variants: trained codec directories whose shapes are timed (scaled to the timing LM)")
    s.add_argument("--default", default=None, help="rkv-variants: the label whose throughput is 1.0")
    s.add_argument("--codec-shape", type=_positive_int, nargs=3, default=None,
                   metavar=("D_KV", "D_C", "D_FF"), help="codec-cost: ResidualKV codec shape (default: Table I Llama)")
    s.add_argument("--tokens", type=_positive_int, default=None, help="codec-cost: tokens coded on the prefill path")
    s.add_argument("--restore-tokens", type=_positive_int, default=None,
                   help="codec-cost: tokens restored per decode step (default: ceil(0.17 x tokens); at most the "
                        "coded context's candidates, the whole codec windows after the sinks)")
    s.set_defaults(func=_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvbench`` console script.

    Bad input (``ValueError``, ``KeyError``, a missing file, or a
    :class:`~kvbench.eval.methods.FatalRunError` such as a method that does not
    fit the model) ends with one line ``kvbench <verb>: error: <message>`` and
    exit status 2 instead of a traceback;
    an interrupted training run exits 130 after saving its state, and one whose
    wall-clock slice ended (:class:`~kvbench.utils.steps.SliceEnded`) exits
    :data:`~kvbench.utils.steps.SLICE_EXIT_CODE` (3) saying how to resume. With ``KVBENCH_JOB_STATS=<file>`` in
    the environment, one JSON line (verb, exit status, wall time, peak CUDA memory) is appended to that file at
    exit (:mod:`kvbench.utils.jobstats`).
    """
    from kvbench.utils.jobstats import recorded

    args = build_parser().parse_args(argv)
    with recorded(args.verb) as job:  # scripts/gpu_paper.sh: one line per job (wall time, peak CUDA memory)
        job["rc"] = _run(args)
    return job["rc"]


def _run(args: argparse.Namespace) -> int:
    """Runs the parsed verb; the exit statuses of :func:`main`."""
    from kvbench.eval.methods import FatalRunError
    from kvbench.train.loop import Interrupted
    from kvbench.utils.steps import SLICE_EXIT_CODE, SliceEnded

    try:
        rc = args.func(args)
    except Interrupted as e:
        print(f"kvbench {args.verb}: {e}", file=sys.stderr)
        return 130
    except SliceEnded as e:
        print(f"kvbench {args.verb}: {e}", file=sys.stderr)
        return SLICE_EXIT_CODE
    except (ValueError, KeyError, FileNotFoundError, FatalRunError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"kvbench {args.verb}: error: {msg}", file=sys.stderr)
        return 2
    return rc or 0


if __name__ == "__main__":
    sys.exit(main())
