"""The one command-line entry point: ``kvbench <verb> ...``.

Every Snakemake rule calls the package through these verbs, so no science
lives in the workflow files. Imports are lazy so ``kvbench --help`` is fast.
"""
from __future__ import annotations

import argparse
import json
import sys


def _tokenizer(a: argparse.Namespace) -> None:
    from kvbench.models.tokenizer import save_tokenizer

    print(json.dumps(save_tokenizer(a.out, vocab_size=a.vocab_size), indent=2))


def _data(a: argparse.Namespace) -> None:
    from kvbench.data.smoke import materialise

    meta = materialise(a.task, a.out, tokenizer_dir=a.tokenizer, seed=a.seed, n_train=a.n_train, n_test=a.n_test)
    print(json.dumps(meta, indent=2, default=str))


def _train(a: argparse.Namespace) -> None:
    from kvbench.train.zoo import train_zoo_model

    try:
        overrides = json.loads(a.overrides) if a.overrides else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"--overrides must be a JSON object, got {a.overrides!r} ({e.msg})") from e
    if not isinstance(overrides, dict):
        raise ValueError(f"--overrides must be a JSON object, got {a.overrides!r}")
    summary = train_zoo_model(
        a.model, tokenizer_dir=a.tokenizer, out_dir=a.out, workdir=a.workdir,
        budget_s=a.budget_s, seed=a.seed, threads=a.threads, overrides=overrides,
    )
    print(json.dumps(summary, indent=2, default=str))


def _eval(a: argparse.Namespace) -> None:
    from kvbench.eval.runner import run_eval

    metrics = run_eval(a.model, a.split, method=a.method, out_dir=a.out, seed=a.seed, limit=a.limit, threads=a.threads)
    print(json.dumps(metrics, indent=2, default=str))


def _report(a: argparse.Namespace) -> None:
    from kvbench.report import zoo

    if a.what == "zoo-figure" and not str(a.out).endswith(".pdf"):
        raise ValueError(f"--out of zoo-figure must end in .pdf, got {a.out!r}")
    if a.what == "zoo":
        zoo.write_zoo_table(a.runs, a.train, a.out)
    elif a.what == "zoo-figure":
        zoo.plot_training_curves(a.train, a.out)


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

    s = sub.add_parser("train", help="train one tiny zoo model on the CPU (resumable)")
    s.add_argument("--model", required=True, help="zoo model name, e.g. tiny-qwen2-lm or tiny-qwen2.5-vl")
    s.add_argument("--tokenizer", required=True)
    s.add_argument("--out", required=True, help="final checkpoint directory (HF save_pretrained layout)")
    s.add_argument("--workdir", required=True, help="resumable training state, loss curves")
    s.add_argument("--budget-s", type=float, required=True, help="wall-clock training budget in seconds")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--overrides", default="", help="JSON object of training-recipe overrides")
    s.set_defaults(func=_train)

    s = sub.add_parser("eval", help="run a method over a benchmark split")
    s.add_argument("--model", required=True, help="HF checkpoint directory or zoo name")
    s.add_argument("--split", required=True, help="JSONL split file")
    s.add_argument("--method", default="full")
    s.add_argument("--out", required=True, help="run directory: predictions.jsonl, metrics.json, run_info.json")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--limit", type=int, default=None, help="evaluate only the first N samples")
    s.add_argument("--threads", type=int, default=1)
    s.set_defaults(func=_eval)

    s = sub.add_parser("report", help="tables and figures from finished runs")
    s.add_argument("what", choices=["zoo", "zoo-figure"])
    s.add_argument("--runs", nargs="*", default=[], help="run directories (eval outputs)")
    s.add_argument("--train", nargs="*", default=[], help="training work directories (curves, summary)")
    s.add_argument("--out", required=True)
    s.set_defaults(func=_report)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvbench`` console script.

    Bad input (``ValueError``, ``KeyError``, a missing file) ends with one line
    ``kvbench <verb>: error: <message>`` and exit status 2 instead of a traceback;
    an interrupted training run exits 130 after saving its state.
    """
    args = build_parser().parse_args(argv)
    from kvbench.train.loop import Interrupted

    try:
        args.func(args)
    except Interrupted as e:
        print(f"kvbench {args.verb}: {e}", file=sys.stderr)
        return 130
    except (ValueError, KeyError, FileNotFoundError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"kvbench {args.verb}: error: {msg}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
