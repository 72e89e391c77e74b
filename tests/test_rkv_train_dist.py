"""Codec training placement (issue #16 item 1): data parallelism over processes (gloo on the CPU, as NCCL on
GPUs), gradient accumulation, activation checkpointing, bf16 autocast, and a local corpus read with `datasets`."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from kvbench.cli import main
from kvbench.compress.residualkv.train import Placement, TokenStream, train_codec
from kvbench.models.loader import load_model
from kvbench.train.dist import World

pytestmark = pytest.mark.usefixtures("one_thread")

ARGS = ["--steps", "3", "--seq-len", "32", "--overrides", '{"n_sink": 4, "stride": 5}', "--threads", "1"]


def _corpus(tmp_path, n: int = 200):
    """A JSONL corpus of ``n`` short English documents in FineWeb-Edu's layout (a ``text`` column)."""
    words = "the cache stores keys and values of every token so that decoding reads them again".split()
    path = tmp_path / "corpus" / "part-000.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i in range(n):
            text = " ".join(words[(i + j) % len(words)] for j in range(20 + i % 13))
            f.write(json.dumps({"id": i, "text": f"Document {i}. {text}."}) + "\n")
    return path


def _codec_bytes(out) -> bytes:
    return (out / "codec" / "codec.safetensors").read_bytes()


def test_two_gloo_processes_equal_one_process_accumulating_the_same_batch(lm_dir, tmp_path):
    """Same global batch (2 sequences per step): 2 processes x 1 under torchrun (gloo) and 1 process x 2
    accumulated give bit-identical codec weights and curves."""
    one, two = tmp_path / "one", tmp_path / "two"
    assert main(["codec-train", "--model", str(lm_dir), "--out", str(one), "--grad-accum", "2", *ARGS]) == 0
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", "-m", "kvbench.cli", "codec-train",
                        "--model", str(lm_dir), "--out", str(two), "--grad-accum", "1", *ARGS],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _codec_bytes(one) == _codec_bytes(two)
    assert (one / "curves.csv").read_bytes() == (two / "curves.csv").read_bytes()
    assert json.loads((two / "state" / "meta.json").read_text())["run"]["batch"] == 2


def test_batch_of_two_is_not_two_steps_of_one(lm_dir, tmp_path):
    """The test above would pass if accumulation were ignored; here batch 2 differs from batch 1."""
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["codec-train", "--model", str(lm_dir), "--out", str(a), "--grad-accum", "2", *ARGS]) == 0
    assert main(["codec-train", "--model", str(lm_dir), "--out", str(b), *ARGS]) == 0
    assert _codec_bytes(a) != _codec_bytes(b)


def test_placement_windows_split_the_global_batch():
    one = Placement(grad_accum=4)
    parts = [Placement(grad_accum=2, world=World(rank=r, size=2)) for r in range(2)]
    assert one.windows(3) == [12, 13, 14, 15]
    assert sorted(parts[0].windows(3) + parts[1].windows(3)) == one.windows(3)
    assert Placement().windows(5) == [5]  # batch 1: window i at step i, as before
    with pytest.raises(ValueError, match="grad_accum must be an int >= 1, got 0"):
        Placement(grad_accum=0)
    with pytest.raises(ValueError, match="dtype must be one of .* got 'int8'"):
        Placement(dtype="int8")


def test_checkpointing_gives_the_same_weights(lm_dir, tokenizer, tmp_path):
    """Recomputing the decoder layers in the backward pass changes memory, not the result."""
    outs = []
    for ckpt in (False, True):
        model, _ = load_model(lm_dir, dtype=torch.float32)
        from kvbench.compress.residualkv.codec import ResidualCodec

        codec = ResidualCodec.for_model(model, n_sink=4, stride=5)
        out = tmp_path / f"ckpt{ckpt}"
        train_codec(model, tokenizer, codec, out_dir=out, steps=2, seq_len=32, progress=False,
                    place=Placement(checkpointing=ckpt))
        assert not getattr(model.model, "gradient_checkpointing", False)  # switched off again
        assert not any(m.training for m in model.modules())  # no module left in training mode
        outs.append(_codec_bytes(out))
    assert outs[0] == outs[1]


def test_bf16_autocast_keeps_float32_codec_and_records_the_dtype(lm_dir, tokenizer, tmp_path):
    from kvbench.compress.residualkv.codec import ResidualCodec

    model, _ = load_model(lm_dir, dtype=torch.bfloat16)
    codec = ResidualCodec.for_model(model, n_sink=4, stride=5)
    s = train_codec(model, tokenizer, codec, out_dir=tmp_path / "bf16", steps=2, seq_len=32, progress=False,
                    place=Placement(dtype="bfloat16"))
    assert all(p.dtype == torch.float32 for p in codec.parameters())
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert torch.isfinite(torch.tensor(s["final_loss"]))
    meta = json.loads((tmp_path / "bf16" / "state" / "meta.json").read_text())
    assert meta["run"]["dtype"] == "bfloat16"


def test_local_corpus_windows_and_training(lm_dir, tokenizer, tmp_path):
    path = _corpus(tmp_path)
    train = TokenStream(tokenizer, "train", 32, seed=0, files=[path])
    val = TokenStream(tokenizer, "test", 32, seed=0, files=[path])
    assert len(train.docs) + len(val.docs) == 200 and 0 < len(val.docs) < 10
    assert set(train.docs).isdisjoint(val.docs)
    assert torch.equal(train.window(3), TokenStream(tokenizer, "train", 32, seed=0, files=[path]).window(3))
    assert "Document" in tokenizer.decode(train.window(0)[0])
    out = tmp_path / "c"
    assert main(["codec-train", "--model", str(lm_dir), "--out", str(out), "--data-files", str(path), *ARGS]) == 0
    meta = json.loads((out / "state" / "meta.json").read_text())
    assert meta["run"]["data_files"] == [str(path.resolve())]
    # the bundled corpus gives other weights: the files were read
    assert main(["codec-train", "--model", str(lm_dir), "--out", str(tmp_path / "d"), *ARGS]) == 0
    assert _codec_bytes(out) != _codec_bytes(tmp_path / "d")


def test_local_corpus_parquet_equals_jsonl(tokenizer, tmp_path):
    import pandas as pd

    path = _corpus(tmp_path)
    pq = tmp_path / "corpus.parquet"
    pd.read_json(path, lines=True).to_parquet(pq)
    a = TokenStream(tokenizer, "train", 32, seed=0, files=[path])
    b = TokenStream(tokenizer, "train", 32, seed=0, files=[pq])
    assert torch.equal(a.window(5), b.window(5))


@pytest.mark.parametrize("argv, needle", [
    (["--data", "tasks", "--data-files", "x.jsonl"], "--data-files is a text corpus or VLM records: it needs --data text or vlm"),
    (["--device", "cuda"], "no CUDA device is visible"),
    (["--dtype", "float16"], "float16' needs a CUDA device"),
    (["--grad-accum", "0"], "argument --grad-accum"),
])
def test_bad_placement_flags_are_refused_before_loading(argv, needle, tmp_path, capsys):
    if argv[:2] == ["--device", "cuda"] and torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    try:
        rc = main(["codec-train", "--model", str(tmp_path / "no-model"), "--out", str(tmp_path / "c"), "--steps", "2",
                   *argv])
    except SystemExit as e:  # argparse's own refusals
        rc = e.code
    assert rc == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("write, needle", [
    (lambda p: p.write_text('{"body": "x"}\n'), "have no column 'text' (columns: ['body'])"),
    (lambda p: p.write_text(""), "hold no documents"),
    (lambda p: p.write_text('{"text": "a"\n'), "could not be read as json"),
])
def test_bad_corpus_files_are_named(write, needle, tokenizer, tmp_path):
    path = tmp_path / "c.jsonl"
    write(path)
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")):
        TokenStream(tokenizer, "train", 32, seed=0, files=[path])


def test_mixed_or_missing_corpus_files_are_refused(tokenizer, tmp_path):
    a = _corpus(tmp_path)
    (tmp_path / "b.csv").write_text("text\nx\n")
    with pytest.raises(ValueError, match=r"share one suffix .* got \['.csv', '.jsonl'\]"):
        TokenStream(tokenizer, "train", 32, seed=0, files=[a, tmp_path / "b.csv"])
    with pytest.raises(ValueError, match="corpus files not found"):
        TokenStream(tokenizer, "train", 32, seed=0, files=[tmp_path / "nope.jsonl"])


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".txt", ".parquet"])
def test_local_corpus_without_datasets_reads_the_same_documents(suffix, tokenizer, tmp_path, monkeypatch):
    """Issue #16 item 3: the bare GPU machine has no `datasets`; the stdlib/pyarrow reader gives the same documents
    (and so the same windows) as `datasets` for each corpus layout."""
    import pandas as pd

    jsonl = _corpus(tmp_path)
    df = pd.read_json(jsonl, lines=True)
    path = tmp_path / f"corpus{suffix}"
    if suffix == ".json":
        df.to_json(path, orient="records")             # one JSON array
    elif suffix == ".txt":
        path.write_text("\n".join(df["text"]) + "\n\nlast line")   # an empty line is a document too
    elif suffix == ".parquet":
        df.to_parquet(path)
    else:
        path = jsonl
    with_ds = TokenStream(tokenizer, "train", 32, seed=0, files=[path])
    monkeypatch.setitem(sys.modules, "datasets", None)    # `import datasets` raises ImportError
    without = TokenStream(tokenizer, "train", 32, seed=0, files=[path])
    assert type(without.docs.table) is list and list(without.docs) == list(with_ds.docs)
    assert torch.equal(with_ds.window(4), without.window(4))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "x"}\n')
    with pytest.raises(ValueError, match=r"have no column 'text' \(columns: \['body'\]\)"):
        TokenStream(tokenizer, "train", 32, seed=0, files=[bad])


# --- review findings (issue #16): each failing input as a test ------------------------------------------------

def test_resume_with_another_batch_or_dtype_names_the_key(lm_dir, tmp_path, capsys):
    """Bug: batch/dtype are absent from the run identity at their defaults, so the refusal listed no key
    ("differs in []")."""
    out = tmp_path / "c"
    assert main(["codec-train", "--model", str(lm_dir), "--out", str(out), "--grad-accum", "2", "--slice-s", "1e-9",
                 *ARGS]) == 3
    assert main(["codec-train", "--model", str(lm_dir), "--out", str(out), *ARGS]) == 2
    assert "another configuration (differs in ['batch'])" in capsys.readouterr().err


def test_a_corpus_replaced_between_slices_is_refused(lm_dir, tmp_path, capsys):
    """Bug: a sliced run resumed silently on another corpus (the state named the paths only)."""
    path, out = _corpus(tmp_path), tmp_path / "c"
    argv = ["codec-train", "--model", str(lm_dir), "--out", str(out), "--data-files", str(path), *ARGS]
    assert main([*argv, "--slice-s", "1e-9"]) == 3
    path.write_text(json.dumps({"text": "one short document"}) + "\n")
    assert main(argv) == 2
    assert "differs in ['data_bytes']" in capsys.readouterr().err


@pytest.mark.parametrize("rows, needle", [
    ([{"text": ""}] * 10, "the corpus holds no text"),                # bug: trained on EOS-only windows
    ([{"text": 5}, {"text": 6}], r"corpus document \d is a int, not text"),  # bug: the tokenizer's internal message
])
def test_corpus_without_text_is_refused(rows, needle, tokenizer, tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    stream = TokenStream(tokenizer, "train", 32, seed=0, files=[path])
    with pytest.raises(ValueError, match=needle):
        stream.window(0)


def test_corpus_directory_and_duplicates(tokenizer, tmp_path):
    path = _corpus(tmp_path)
    with pytest.raises(ValueError, match="are directories: list their files"):  # bug: reported as "not found"
        TokenStream(tokenizer, "train", 32, seed=0, files=[path.parent])
    once = TokenStream(tokenizer, "train", 32, seed=0, files=[path])
    twice = TokenStream(tokenizer, "train", 32, seed=0, files=[path, path])  # bug: a file listed twice was read twice
    assert len(once.docs) == len(twice.docs)


@pytest.mark.parametrize("argv, needle", [
    (["--device", "banana"], "expected auto, cpu, cuda or cuda:<index>, got 'banana'"),  # bug: a raw traceback
    (["--text-field", "body"], "--text-field 'body' names a column of --data-files"),     # bug: silently ignored
])
def test_more_bad_flags_are_refused(argv, needle, tmp_path, capsys):
    try:
        rc = main(["codec-train", "--model", str(tmp_path / "no-model"), "--out", str(tmp_path / "c"), "--steps", "2",
                   *argv])
    except SystemExit as e:
        rc = e.code
    assert rc == 2 and needle in capsys.readouterr().err


def test_nan_alpha_is_refused():
    """Bug: an imported compressor's stride_alpha NaN passed `alpha >= 0` and wrote "alpha": NaN to codec.json."""
    from kvbench.compress.residualkv.codec import CodecConfig

    with pytest.raises(ValueError, match="alpha must be a finite number >= 0, got nan"):
        CodecConfig(n_layers=1, d_kv=64, d_c=16, d_ff=32, group=16, alpha=float("nan"))


def test_train_codec_refuses_corpus_files_with_task_data(lm_dir, tokenizer, tmp_path):
    """The library call checks what the CLI checks before loading (the task stream reads no files)."""
    from kvbench.compress.residualkv.codec import ResidualCodec

    model, _ = load_model(lm_dir, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"data_files are a text corpus or VLM records: they need data in \('text', 'vlm'\), got data='tasks'"):
        train_codec(model, tokenizer, ResidualCodec.for_model(model), out_dir=tmp_path / "c", steps=1, data="tasks",
                    data_files=[_corpus(tmp_path)], progress=False)
