"""SCBench's own task files -> kvbench multi-query records (the paper profile's ResidualKV Table IV).

SCBench (Li et al., arXiv 2412.10319) ships one JSONL per task (``microsoft/SCBench`` ``data/<task>.jsonl``), each
line ``{"context": str, "multi_turns": [{"input": str, "answer": str | [str] | int, ...}, ...], ...}`` (some tasks
add per-turn ``task``, e.g. summary-with-needles). :func:`convert` writes them as multi-query records
(:mod:`kvbench.eval.multiquery`) the way SCBench's SCDQ mode prompts them (``create_scdq_prompt`` in
``scbench/eval_utils.py`` at ``microsoft/MInference``): the context inside the task's SCDQ context template
(``multiturn_templates_scdq``), each query in the task's query template, the decode budget of
``DATA_NAME_TO_MAX_NEW_TOKENS`` and the scorer of ``compute_scores.py`` (:mod:`kvbench.eval.scbench_metrics`).

One difference, said here and in the records' ``meta.prompt``: SCBench's SCDQ prompts concatenate the token ids of
the context prompt and of the query with nothing between them unless a chat template is used; kvbench prompts are
raw text (``context + question``, docs/architecture.md), so each query starts with ``"\\n\\n"``, as SCBench's
multi-turn template (``"{context}\\n\\n{input}"``) separates them. No chat template is applied.

Tasks: the string-retrieval, QA, many-shot and summary tasks of the paper's SCDQ subset (:data:`TASKS`); RepoQA
and the multiple-choice task need scorers kvbench does not have (RepoQA's is a code-similarity pass@1 over
function bodies) and are refused by name.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvbench.utils import io

#: The field of a multi-query record that holds its queries (SCBench's name; :mod:`kvbench.eval.multiquery`).
TURNS = "multi_turns"


@dataclass(frozen=True)
class SCBTask:
    """How one SCBench task is prompted and scored in SCDQ mode.

    ``context``: the context template (``{context}``); ``query``: the query template (``{input}``); ``metric``:
    a :mod:`kvbench.eval.scbench_metrics` name; ``max_new_tokens``: SCBench's decode budget; ``turns``: per turn
    ``task`` (mixed tasks), the ``(metric, max_new_tokens)`` of that sub-task instead.
    """

    context: str
    query: str
    metric: str
    max_new_tokens: int
    turns: dict[str, tuple[str, int]] | None = None


_KV = "Extract the value corresponding to the specified key in the JSON object below.\n\n{context}"
#: SCBench tasks :func:`convert` serves (``scbench/eval_utils.py`` and ``compute_scores.py`` at MInference 9987de6).
TASKS: dict[str, SCBTask] = {
    "scbench_kv": SCBTask(_KV, "{input}", "scb_substring", 150),
    "scbench_kv_hard": SCBTask(_KV, "{input}", "scb_substring", 150),
    "scbench_prefix_suffix": SCBTask("{context}", "{input}", "scb_substring", 150),
    "scbench_vt": SCBTask("{context}", "{input}", "scb_all_lower", 30),
    "scbench_qa_eng": SCBTask("Read the book and answer the question. Be very concise in your answer.\n\n{context}",
                              "Question: {input}\nAnswer:", "scb_any_upper", 40),
    "scbench_many_shot": SCBTask("{context}", "{input}", "scb_any_upper", 10),
    "scbench_summary": SCBTask("{context}", "{input}", "scb_rouge_lsum", 200),
    "scbench_summary_with_needles": SCBTask("{context}", "{input}", "scb_rouge_lsum", 800, turns={
        "scbench_summary": ("scb_rouge_lsum", 800), "scbench_passkey": ("scb_first_int", 15)}),
}
#: Separator put before every query (module doc).
SEPARATOR = "\n\n"


def _answer(a, where: str) -> str | list[str]:
    if isinstance(a, bool) or a is None:
        raise ValueError(f"{where}: 'answer' must be a string, a number or a list of them, got {a!r}")
    if isinstance(a, (str, int, float)):
        return str(a)
    if isinstance(a, list) and a and all(isinstance(x, (str, int, float)) and not isinstance(x, bool) for x in a):
        return [str(x) for x in a]
    raise ValueError(f"{where}: 'answer' must be a string, a number or a non-empty list of them, got {a!r}")


def convert_record(raw: dict, task: str, index: int) -> dict:
    """One SCBench line -> a kvbench multi-query record ``<task>-<index:05d>``.

    Raises:
        ValueError: naming the line and field: no string ``context`` (or ``input``, SCBench's other name for it), no
            non-empty ``multi_turns``, a turn without a string ``input`` or a usable ``answer``, a mixed task's turn
            whose ``task`` is not one of its sub-tasks.
    """
    spec = TASKS[task]
    where = f"{task} line {index + 1}"
    context = raw.get("context", raw.get("input"))
    if not isinstance(context, str) or not context:
        raise ValueError(f"{where}: needs a non-empty string 'context', got {type(context).__name__}")
    turns_in = raw.get(TURNS)
    if not isinstance(turns_in, list) or not turns_in:
        raise ValueError(f"{where}: needs a non-empty list {TURNS!r}")
    turns = []
    for j, t in enumerate(turns_in):
        at = f"{where}, {TURNS}[{j}]"
        if not isinstance(t, dict) or not isinstance(t.get("input"), str):
            raise ValueError(f"{at}: needs a string 'input'")
        turn = {"input": SEPARATOR + spec.query.format(input=t["input"]), "answer": _answer(t.get("answer"), at)}
        if spec.turns is not None:
            sub = t.get("task")
            if sub not in spec.turns:
                raise ValueError(f"{at}: 'task' must be one of {sorted(spec.turns)}, got {sub!r}")
            turn["metric"], turn["max_new_tokens"] = spec.turns[sub]
        turns.append(turn)
    return {"id": f"{task}-{index:05d}", "task": task, "split": "test", "kind": "text",
            "context": spec.context.format(context=context), TURNS: turns, "max_new_tokens": spec.max_new_tokens,
            "metric": spec.metric, "chance": 0.0,
            "meta": {"source": "SCBench", "scbench_id": raw.get("id"),
                     "prompt": "SCBench SCDQ templates, raw text, '\\n\\n' before each query (kvbench.data.scbench)"}}


def convert(task: str, src: str | Path, out: str | Path) -> dict:
    """Convert SCBench's file ``src`` of ``task`` into ``out`` (a JSONL of multi-query records, written atomically).

    Returns:
        ``{"task", "source", "source_sha256", "n", "n_queries"}``.

    Raises:
        ValueError: an SCBench task :data:`TASKS` does not serve (naming those it does), an empty file, or a bad
            line (:func:`convert_record`).
        FileNotFoundError: ``src`` does not exist.
    """
    if task not in TASKS:
        raise ValueError(f"SCBench task {task!r} is not converted; kvbench serves {sorted(TASKS)} (RepoQA and the "
                         "multiple-choice task need scorers kvbench does not have)")
    raw = io.read_jsonl(src)
    if not raw:
        raise ValueError(f"{src}: no SCBench records")
    records = [convert_record(r, task, i) for i, r in enumerate(raw)]
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    io.write_jsonl(out, records)
    return {"task": task, "source": str(src), "source_sha256": io.sha256_file(src), "n": len(records),
            "n_queries": sum(len(r[TURNS]) for r in records)}
