"""Smoke benchmark generators: record contract, split disjointness, token lengths, determinism."""
from __future__ import annotations

import json
import random
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from kvbench.data import corpus, digitgrid, digits, docpages, instructions, lcc, lexicon, longctx, smoke

COMMON = {"id": str, "task": str, "split": str, "kind": str, "question": str, "answer": str,
          "max_new_tokens": int, "metric": str, "chance": float, "meta": dict}


def check_record(rec: dict, base_dir: Path | None = None) -> None:
    """Assert ``rec`` follows docs/architecture.md (images: PIL in memory, or paths under ``base_dir``)."""
    for k, t in COMMON.items():
        assert isinstance(rec[k], t), (k, rec.get(k))
    assert rec["split"] in ("train", "test") and rec["kind"] in ("text", "vlm")
    assert rec["metric"] in ("exact_match", "edit_sim") and 0.0 <= rec["chance"] <= 1.0
    assert rec["max_new_tokens"] >= 1
    if rec["kind"] == "text":
        assert set(rec) == set(COMMON) | {"context"} and isinstance(rec["context"], str)
    else:
        assert set(rec) == set(COMMON) | {"system", "generic_system", "content"}
        assert rec["system"] != rec["generic_system"] == instructions.GENERIC_SYSTEM
        for part in rec["content"]:
            assert part["type"] in ("text", "image")
            if part["type"] == "image":
                if base_dir is None:
                    assert isinstance(part["image"], Image.Image)
                else:
                    assert re.fullmatch(r"images/[0-9a-f]{32}\.png", part["image"]) and (base_dir / part["image"]).is_file()
    extra = rec["meta"].get("extra_queries")
    assert (extra is not None) == (rec["split"] == "train") or (extra and rec["split"] == "test")
    for q in extra or []:
        assert set(q) == {"question", "answer"}


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------- digits / instructions / VLM tasks

def test_digit_pools_disjoint_and_cover_all():
    train, test = set(digits.pool("train")), set(digits.pool("test"))
    assert not train & test and len(train | test) == len(digits.labels()) == 1797
    assert all(i % 5 == 0 for i in test) and len(test) == 360
    with pytest.raises(ValueError, match="'dev'"):
        digits.pool("dev")


def test_render_cell_and_page_geometry():
    cell = digits.render_cell(digits.images()[0])
    assert cell.shape == (28, 28, 3) and cell.dtype == np.uint8
    assert cell[0, 0].tolist() == [255, 255, 255] and cell.min() < 64  # white paper, dark ink
    page = digits.render_page(list(range(6)), rows=2, cols=3)
    assert page.size == (3 * 28, 2 * 28) and page.mode == "RGB"
    assert np.array_equal(np.asarray(page)[28:56, 0:28], digits.render_cell(digits.images()[3]))  # row-major
    with pytest.raises(ValueError, match="rows\\*cols = 6"):
        digits.render_page([0, 1], rows=2, cols=3)
    with pytest.raises(ValueError, match="\\(8, 8\\)"):
        digits.render_cell(np.zeros((28, 28)))


def test_labelled_cell_prints_code_above_the_scan():
    scan = digits.images()[0]
    a, b, c = (digits.render_cell(scan, lab)[:, :, 0] for lab in ("3E", "4E", " E"))
    assert np.array_equal(a[14:], b[14:])  # same handwriting band
    assert not np.array_equal(a[:14, :14], b[:14, :14])  # page digit in the left top patch
    assert np.array_equal(a[:14, 14:], b[:14, 14:])  # letter in the right top patch
    assert c[:14, :14].min() == 255  # a space leaves the patch blank
    assert a[14:].min() < 64  # ink of the scan
    page = digits.render_page([0, 1], rows=1, cols=2, labels=["1A", "1B"])
    assert np.array_equal(np.asarray(page)[:, 28:], digits.render_cell(digits.images()[1], "1B"))
    with pytest.raises(ValueError, match="exactly 2 characters"):
        digits.render_cell(scan, "12E")
    with pytest.raises(ValueError, match="2 labels"):
        digits.render_page([0, 1], rows=1, cols=2, labels=["1A"])


def test_instructions_change_the_answer_and_prefix():
    assert [instructions.apply(n, 3) for n in ("identity", "plus_one", "plus_five", "nine_minus")] == [3, 4, 8, 6]
    for name in instructions.INSTRUCTIONS:  # every instruction is a bijection on digits
        assert sorted(instructions.apply(name, d) for d in range(10)) == list(range(10))
    rng = random.Random(0)
    for _ in range(50):
        name, system = instructions.sample_system(rng)
        assert system.endswith(instructions.INSTRUCTIONS[name].text) and system != instructions.GENERIC_SYSTEM
    with pytest.raises(ValueError, match="'minus_two'"):
        instructions.apply("minus_two", 1)


@pytest.mark.parametrize("family,side,cells", [("docpages", 56, 4), ("digitgrid", 112, 16)])
def test_vlm_records(family, side, cells):
    labels = digits.labels()
    for i in range(20):
        for split in ("train", "test"):
            rec = smoke.sample(family, random.Random(i), split)
            check_record(rec)
            m = rec["meta"]
            pages = [p["image"] for p in rec["content"] if p["type"] == "image"]
            assert len(pages) == m["K"] == len(m["digit_indices"])
            assert all(p.size == (side, side) for p in pages)  # 28 px per cell: one visual token each
            assert all(len(ix) == cells for ix in m["digit_indices"])
            pool = set(digits.pool(split))
            assert all(j in pool for ix in m["digit_indices"] for j in ix)
            grid = int(cells ** 0.5)
            cell = (m["row"] - 1) * grid + m["col"] - 1
            scan = m["digit_indices"][m["page"] - 1][cell]
            assert m["digit"] == labels[scan]
            letter = "ABCDEFGHIJKLMNOPQRSTUVWX"[(m["page"] - 1) * cells + cell]  # codes run on across pages
            code = (str(m["page"]) if family == "docpages" else " ") + letter
            r, c = divmod(cell, grid)
            page_px = np.asarray(pages[m["page"] - 1])[28 * r:28 * r + 28, 28 * c:28 * c + 28]
            assert np.array_equal(page_px, digits.render_cell(digits.images()[scan], code))  # printed field code
            assert rec["answer"] == str(instructions.apply(m["instruction"], m["digit"]))
            assert rec["max_new_tokens"] == 1 and rec["chance"] == 0.1 and rec["metric"] == "exact_match"
            if family == "docpages":
                assert 2 <= m["K"] <= 6
                assert [p["text"] for p in rec["content"] if p["type"] == "text"] == [f"Page {k}:" for k in range(1, m["K"] + 1)]
                assert rec["question"] == f"Page {m['page']}, cell {letter}"
            else:
                assert m["K"] == 1 and len(rec["content"]) == 1
                assert rec["question"] == f"Cell {letter}"
            if split == "train":
                assert len(m["extra_queries"]) == 7  # 8 queries per training sequence by default
    rec = docpages.sample(random.Random(0), "train", n_queries=5, K=3, instruction="plus_five")
    assert rec["meta"]["K"] == 3 and len(rec["meta"]["extra_queries"]) == 4 and rec["meta"]["instruction"] == "plus_five"
    with pytest.raises(ValueError, match="K must be 1, got 2"):
        digitgrid.sample(random.Random(0), "test", K=2)
    with pytest.raises(ValueError, match="n_queries must be in 1..16"):
        digitgrid.sample(random.Random(0), "test", n_queries=17)


# ---------------------------------------------------------------- long-context text tasks

@pytest.mark.parametrize("family,L", [("niah", 1024), ("kv", 1024), ("vt", 1024), ("niah", 2048), ("vt", 256)])
def test_text_lengths_in_tokens(tokenizer, family, L):
    for i in range(8):
        for split in ("train", "test"):
            rec = smoke.sample(family, random.Random(i), split, tokenizer, length_tokens=L)
            check_record(rec)
            n = len(ids(tokenizer, rec["context"] + rec["question"]))
            assert L - longctx.LENGTH_TOLERANCE <= n <= L and n == rec["meta"]["n_tokens"]
            assert n >= L - 32  # filled to the last whole word that fits


@pytest.mark.parametrize("family", ["niah", "kv"])
def test_retrieval_is_one_token_induction(tokenizer, family):
    keys, values = set(lexicon.key_codes()), set(lexicon.value_codes())
    for i in range(10):
        rec = smoke.sample(family, random.Random(i), "train", tokenizer, length_tokens=512, n_queries=3)
        assert len(rec["meta"]["extra_queries"]) == 2
        ctx = ids(tokenizer, rec["context"])
        for q in [{"question": rec["question"], "answer": rec["answer"]}] + rec["meta"]["extra_queries"]:
            key = q["question"].rsplit(" ", 1)[1]
            assert q["question"] == f"\nQuery: {key}" and key in keys and q["answer"][1:] in values
            (k_id,), (v_id,) = ids(tokenizer, " " + key), ids(tokenizer, q["answer"])  # one token each
            assert ids(tokenizer, q["question"])[-1] == k_id  # the question ends with the key token
            pos = [j for j, t in enumerate(ctx) if t == k_id]
            assert len(pos) == 1 and ctx[pos[0] + 1] == v_id  # a plain induction lookup
            if family == "niah":
                assert rec["context"].count(key) == 1  # the code never occurs in the prose otherwise
        assert rec["chance"] == pytest.approx(1 / 90)


@pytest.mark.parametrize("family,L", [("niah", 1024), ("kv", 128)])
def test_multi_token_values_are_chains_of_induction_lookups(tokenizer, family, L):
    """``value_tokens=4`` (issue #32, item 3): the answer is 4 value codes, each occurring once in the record, so
    every answer token follows its predecessor in the context; lengths and ``max_new_tokens`` follow."""
    values = set(lexicon.value_codes())
    for i in range(6):
        for split, length in (("train", L), ("test", L), ("train", 64)):
            rec = smoke.sample(family, random.Random(i), split, tokenizer, length_tokens=length, value_tokens=4,
                               n_queries=2 if length == 64 or family == "kv" else None)
            check_record(rec)
            assert length - longctx.LENGTH_TOLERANCE <= rec["meta"]["n_tokens"] <= length
            assert rec["max_new_tokens"] == 4 and rec["meta"]["value_tokens"] == 4
            ctx = ids(tokenizer, rec["context"])
            for q in [{"question": rec["question"], "answer": rec["answer"]}] + rec["meta"].get("extra_queries", []):
                assert set(q["answer"].split()) <= values
                chain = [ids(tokenizer, q["question"])[-1]] + ids(tokenizer, q["answer"])
                assert len(chain) == 5
                for a, b in zip(chain, chain[1:]):
                    pos = [j for j, t in enumerate(ctx) if t == a]
                    assert len(pos) == 1 and ctx[pos[0] + 1] == b
            assert 0 < rec["chance"] < 1e-7
    with pytest.raises(ValueError, match="value_tokens must be an integer >= 1, got 0"):
        smoke.sample(family, random.Random(0), "test", tokenizer, value_tokens=0)
    if family == "niah":   # more distinct value codes than the lexicon has
        with pytest.raises(ValueError, match="30 values of value_tokens=4 distinct codes need 120 codes, only"):
            smoke.sample(family, random.Random(0), "test", tokenizer, length_tokens=1024, value_tokens=4, n_queries=30)
    else:
        with pytest.raises(ValueError, match="kv at length_tokens=1024 with value_tokens=4 needs 672 distinct value "
                                             "codes for its 168 pairs, the lexicon has 90"):
            smoke.sample(family, random.Random(0), "test", tokenizer, length_tokens=1024, value_tokens=4)


def test_vt_chain_follows_statements(tokenizer):
    for i in range(10):
        rec = smoke.sample("vt", random.Random(i), "test", tokenizer, length_tokens=1024)
        m = rec["meta"]
        assert m["hops"] == 2 and rec["max_new_tokens"] == 2 and 3 <= m["n_chains"] <= 4
        assert rec["question"] == f"\nChain: {m['num']}"
        value_of, holders = {m["num"]: m["num"]}, []
        for src, dst in re.findall(r" ([A-Za-z]{3}) ([A-Z]{3})\.", rec["context"]):
            if src in value_of:
                value_of[dst] = value_of[src]
                holders.append(dst)
        assert holders == m["chain"] and rec["answer"] == "".join(f" {x}" for x in holders)
        assert len(ids(tokenizer, rec["answer"])) == m["hops"]
        ctx = ids(tokenizer, rec["context"])
        assert ctx.count(ids(tokenizer, " " + m["num"])[0]) == 1
        assert rec["chance"] == pytest.approx((1 / (m["hops"] * m["n_chains"])) ** m["hops"])


def test_vt_with_value_code_variables(tokenizer):
    """``variables="values"`` (``vt_1k_values``): the chain's variables are value codes and NUM a key code, each
    once in the record, and the chain still follows the statements; a bad value is refused by name."""
    values, keys = set(lexicon.value_codes()), set(lexicon.key_codes())
    for i in range(8):
        rec = smoke.sample("vt", random.Random(i), "test", tokenizer, length_tokens=1024, variables="values")
        check_record(rec)
        m = rec["meta"]
        assert m["num"] in keys and set(m["chain"]) <= values and rec["answer"] == "".join(f" {x}" for x in m["chain"])
        ctx = ids(tokenizer, rec["context"])
        counts = [ctx.count(ids(tokenizer, " " + code)[0]) for code in [m["num"]] + m["chain"]]
        assert counts == [1] + [2] * (m["hops"] - 1) + [1]   # each variable but the last also starts a statement
        assert 1024 - longctx.LENGTH_TOLERANCE <= m["n_tokens"] <= 1024
    with pytest.raises(ValueError, match="vt variables must be 'keys' or 'values', got 'nums'"):
        smoke.sample("vt", random.Random(0), "test", tokenizer, variables="nums")
    with pytest.raises(ValueError, match=r"vt needs 100 distinct variables \(4 chains of 25 hops\), only \d+ value codes"):
        smoke.sample("vt", random.Random(0), "test", tokenizer, length_tokens=2048, hops=25, n_distractors=3,
                     variables="values")


def test_text_counts_must_be_integers(tokenizer):
    """Review finding (issue #32): a float or string count gave a TypeError deep in the generator, and a bool or a
    float length passed (``max_new_tokens: true`` in the record); each is refused by name."""
    for fam, kw, needle in (("vt", {"hops": "2"}, "vt hops must be an integer >= 1, got '2'"),
                            ("vt", {"hops": 2.0}, "vt hops must be an integer >= 1, got 2.0"),
                            ("vt", {"hops": True}, "vt hops must be an integer >= 1, got True"),
                            ("vt", {"n_distractors": 1.5}, "vt n_distractors must be an integer >= 0, got 1.5"),
                            ("kv", {"n_queries": True}, "kv n_queries must be an integer >= 1, got True"),
                            ("niah", {"n_queries": 0}, "niah n_queries must be an integer >= 1, got 0"),
                            ("niah", {"length_tokens": 1024.0}, "length_tokens must be an integer >= 16, got 1024.0")):
        with pytest.raises(ValueError, match=re.escape(needle)):
            smoke.sample(fam, random.Random(0), "test", tokenizer, **kw)


def test_text_param_errors(tokenizer):
    with pytest.raises(ValueError, match="pass tokenizer="):
        smoke.sample("niah", random.Random(0), "test")
    with pytest.raises(ValueError, match="unknown task family 'needle'"):
        smoke.sample("needle", random.Random(0), "test", tokenizer)
    with pytest.raises(ValueError, match="too short"):
        smoke.sample("vt", random.Random(0), "test", tokenizer, length_tokens=20, hops=3, n_distractors=3)
    with pytest.raises(ValueError, match="split must be"):
        smoke.sample("kv", random.Random(0), "dev", tokenizer)


# ---------------------------------------------------------------- LCC

def test_lcc_chance_is_edit_sim_of_copying_the_last_line():
    assert lcc.copy_last_line_baseline("a = 1\n\n    b = 2\n    ", "b = 3") == lcc.edit_sim("b = 2", "b = 3")


def test_lcc_records(tokenizer):
    test_files = {p for p, _ in corpus.stdlib_files("test")}
    assert not test_files & {p for p, _ in corpus.stdlib_files("train")}
    for i in range(12):
        for split in ("train", "test"):
            rec = smoke.sample("lcc", random.Random(i), split, tokenizer)
            check_record(rec)
            m = rec["meta"]
            assert (m["file"] in test_files) == (split == "test") and m["mode"] == "prefix"
            text = dict(corpus.stdlib_files(split))[m["file"]]
            lines = text.split("\n")
            assert text.startswith(rec["context"]) and m["line"] > lcc.MIN_LINES
            assert rec["context"].count("\n") == m["line"] - 1 and lines[m["line"] - 1].strip() == rec["answer"]
            assert rec["question"] == "" and rec["metric"] == "edit_sim" and rec["max_new_tokens"] == 48
            assert len(ids(tokenizer, rec["context"])) <= 1000
            assert rec["chance"] == lcc.copy_last_line_baseline(rec["context"], rec["answer"])
    rec = smoke.sample("lcc", random.Random(0), "train", tokenizer, length_tokens=64)  # short training lengths
    assert len(ids(tokenizer, rec["context"])) <= 64 and rec["meta"]["mode"] == "window"


# ---------------------------------------------------------------- materialise

def test_task_registry_and_unknown_task(tmp_path):
    assert set(smoke.TASKS) == ({"docpages", "digitgrid", "lcc", "chain_128", "chain_pairs_64"}
                                | {f"{f}_{k}k" for f in ("niah", "kv", "vt") for k in (1, 2, 4)}
                                | {f"{f}_1k_mq" for f in ("niah", "kv", "vt")}   # multi-query: ResidualKV Table IV
                                | {"niah_1k_v4", "vt_1k_values"})   # four-token values; value-code variables
    assert smoke.TASKS["niah_1k_v4"].params == {"length_tokens": 1024, "value_tokens": 4}
    assert smoke.TASKS["kv_2k"].params == {"length_tokens": 2048}
    with pytest.raises(ValueError, match="unknown smoke task 'niah_8k'.*niah_1k.*lcc"):
        smoke.materialise("niah_8k", tmp_path, None)


def _materialise_twice(task, tmp_path, tokenizer_dir, **kw):
    metas = [smoke.materialise(task, tmp_path / f"run{r}", tokenizer_dir, seed=3, **kw) for r in (0, 1)]
    assert metas[0]["sha256"] == metas[1]["sha256"]
    out = tmp_path / "run0"
    assert json.loads((out / "meta.json").read_text()) == json.loads(json.dumps(metas[0]))
    return metas[0], out


def test_materialise_vlm_deterministic_and_disjoint(tmp_path):
    meta, out = _materialise_twice("docpages", tmp_path, None, n_train=6, n_test=5)
    assert meta["n"] == {"train": 6, "test": 5} and meta["mean_chance"]["test"] == pytest.approx(0.1)
    for split in ("train", "test"):
        rows = [json.loads(x) for x in (out / f"{split}.jsonl").read_text().splitlines()]
        assert [r["id"] for r in rows] == [f"docpages-{split}-{i:05d}" for i in range(len(rows))]
        pool = set(digits.pool(split))
        for r in rows:
            check_record(r, base_dir=out)
            assert all(j in pool for ix in r["meta"]["digit_indices"] for j in ix)
            for p in r["content"]:
                if p["type"] == "image":
                    assert Image.open(out / p["image"]).size == (56, 56)
    other = smoke.materialise("docpages", tmp_path / "seed4", None, seed=4, n_train=6, n_test=5)
    assert other["sha256"] != meta["sha256"]


def test_materialise_text_deterministic(tmp_path, tokenizer_dir):
    meta, out = _materialise_twice("niah_1k", tmp_path, tokenizer_dir, n_train=4, n_test=4)
    assert meta["generator"] == "kvbench.data.longctx" and meta["params"] == {"length_tokens": 1024}
    rows = [json.loads(x) for x in (out / "test.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(r["task"] == "niah_1k" for r in rows)
    for r in rows:
        check_record(r)
    assert not (out / "images").exists()
    prefix = smoke.materialise("niah_1k", tmp_path / "more", tokenizer_dir, seed=3, n_train=0, n_test=6)
    more = [json.loads(x) for x in (tmp_path / "more" / "test.jsonl").read_text().splitlines()]
    assert more[:4] == rows and prefix["n"] == {"train": 0, "test": 6}  # records do not depend on n
