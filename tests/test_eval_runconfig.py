"""kvbench.eval.runconfig: every run directory records config.yaml, and `kvbench eval --from DIR` repeats the run
from it alone (byte-identical predictions and metrics), refusing changed inputs and bad files."""
from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import yaml
from _zoo_fixtures import text_record, write_split

from kvbench.cli import main
from kvbench.eval.runconfig import CONFIG_FILE, FORMAT, SECTIONS, read_config, sha256
from kvbench.eval.runner import run_eval

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def run(lm_dir, tmp_path_factory):
    """A finished 3-record ``snapkv`` run (a method with resolved defaults) over its own split."""
    tmp = tmp_path_factory.mktemp("runcfg")
    split = write_split(tmp / "data" / "test.jsonl", [text_record(i) for i in range(4)])
    out = tmp / "run"
    run_eval(lm_dir, split, method="snapkv:keep=0.5", out_dir=out, limit=3)
    return out


def _config(run_dir) -> dict:
    return yaml.safe_load((run_dir / CONFIG_FILE).read_text())


def _edited(run, tmp_path, edit) -> str:
    """A copy of ``run`` whose config.yaml went through ``edit(config)``; returns the directory."""
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    cfg = _config(copy)
    edit(cfg)
    (copy / CONFIG_FILE).write_text(yaml.safe_dump(cfg))
    return str(copy)


def test_run_writes_its_resolved_config(run, lm_dir):
    text = (run / CONFIG_FILE).read_text()
    cfg = yaml.safe_load(text)
    assert tuple(sorted(cfg)) == tuple(sorted(SECTIONS)) and cfg["format"] == FORMAT
    split = run.parent / "data" / "test.jsonl"  # the fixture's split (a tautology compared the value with itself)
    assert cfg["run"] == {"model": str(lm_dir), "split": str(split), "method": "snapkv:keep=0.5",
                          "method_params": {}, "seed": 0, "limit": 3, "threads": 1, "device": "cpu"}
    # hashes checked with hashlib, not with the module's own sha256
    assert cfg["split"]["sha256"] == hashlib.sha256(split.read_bytes()).hexdigest() and cfg["split"]["n_records"] == 3
    m = cfg["model"]
    assert m["architecture"] == "Qwen2ForCausalLM" and m["dtype"] == "torch.float32" and m["n_params"] > 0
    assert m["config_sha256"] == hashlib.sha256((lm_dir / "config.json").read_bytes()).hexdigest()
    assert [w["file"] for w in m["weights"]] == ["model.safetensors"] and len(m["weights"][0]["sha256"]) == 64
    # the method's resolved fields, defaults filled in (SnapKV's window and kernel were not in the spec)
    press = cfg["method"]["press"]
    assert press["class"] == "SnapKVPress" and press["keep"] == 0.5 and "window" in press and "kernel" in press
    assert cfg["protocol"]["press_protocol"] == "shared_context" and "greedy" in cfg["protocol"]["decoding"]
    assert cfg["versions"]["torch"] and cfg["versions"]["transformers"] and "commit" in cfg["git"]
    assert cfg["inputs"] == []
    assert text.startswith("# kvbench run configuration")
    # run_info.json keeps only the invocation's circumstances: config.yaml is the one record of the config
    info = json.loads((run / "run_info.json").read_text())
    assert info["config"] == CONFIG_FILE and not {"args", "method", "model", "split", "versions", "git"} & set(info)
    assert info["wall_s"] > 0 and info["hostname"]


def test_from_repeats_the_run_byte_for_byte(run, tmp_path, capsys):
    """`kvbench eval --from DIR --out NEW` with no other flag: same predictions, metrics and config bytes."""
    new = tmp_path / "again"
    assert main(["eval", "--from", str(run), "--out", str(new)]) == 0
    for name in ("predictions.jsonl", "metrics.json", CONFIG_FILE):
        assert (new / name).read_bytes() == (run / name).read_bytes(), name
    assert "predictions.jsonl, metrics.json of" in capsys.readouterr().err


def test_from_in_place_refuses_a_finished_run_and_resumes_an_unfinished_one(run, tmp_path, capsys):
    """Bug (review): in place, --from replaced a finished run's predictions with the repeat's (different ones after a
    tokenizer change) and exited 0, destroying what the repeat should be compared with."""
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    before = (copy / "predictions.jsonl").read_bytes()
    assert main(["eval", "--from", str(copy)]) == 2
    assert "is a finished run: repeat it into another directory with --out NEW" in capsys.readouterr().err
    assert (copy / "predictions.jsonl").read_bytes() == before
    (copy / "metrics.json").unlink()  # unfinished: in place, --from resumes it
    assert main(["eval", "--from", str(copy), "--threads", "1"]) == 0
    for name in ("predictions.jsonl", "metrics.json", CONFIG_FILE):
        assert (copy / name).read_bytes() == (run / name).read_bytes(), name


def test_from_refuses_a_changed_tokenizer(lm_dir, tmp_path, capsys):
    """Bug (review): config.yaml hashed only config.json and the weights, so a changed tokenizer.json passed the
    checks and changed the predictions."""
    ckpt = tmp_path / "lm"
    shutil.copytree(lm_dir, ckpt)
    split = write_split(tmp_path / "data" / "test.jsonl", [text_record(i) for i in range(2)])
    run_eval(ckpt, split, method="full", out_dir=tmp_path / "r0", limit=1)
    files = [f["file"] for f in _config(tmp_path / "r0")["model"]["files"]]
    assert "tokenizer.json" in files and "tokenizer_config.json" in files
    tok = ckpt / "tokenizer.json"
    tok.write_text(tok.read_text().replace('"unk_token"', '"unk_token" ', 1))
    assert main(["eval", "--from", str(tmp_path / "r0"), "--out", str(tmp_path / "r1")]) == 2
    assert f"model file {tok} changed since the run" in capsys.readouterr().err


def test_from_refuses_a_changed_split(run, tmp_path, capsys):
    split = tmp_path / "test.jsonl"
    shutil.copy(_config(run)["run"]["split"], split)
    recorded = sha256(split)
    d = _edited(run, tmp_path, lambda c: c["run"].update(split=str(split)))
    split.write_text(split.read_text().replace('"t0"', '"t9"'))  # one record id changed
    assert main(["eval", "--from", d, "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert f"split {split} changed since the run: sha256 {sha256(split)}, recorded {recorded}" in err
    split.unlink()
    assert main(["eval", "--from", d, "--out", str(tmp_path / "r")]) == 2
    assert f"split {str(split)!r} named by the run's config.yaml does not exist" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_from_refuses_a_changed_checkpoint(run, lm_dir, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(lm_dir, ckpt)
    d = _edited(run, tmp_path, lambda c: c["run"].update(model=str(ckpt)))
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4] + b"\0\0\0\1")
    assert main(["eval", "--from", d, "--out", str(tmp_path / "r")]) == 2
    assert f"model file {weights} changed since the run: sha256 {sha256(weights)}, recorded" in capsys.readouterr().err


@pytest.mark.parametrize("edit, needle", [
    (lambda c: c.update(extra=1), "unknown key(s) ['extra']"),
    (lambda c: c["run"].update(sed=1), "run: unknown key(s) ['sed']"),
    (lambda c: c["run"].pop("seed"), "run: missing key(s) ['seed']"),
    (lambda c: c.pop("split"), "missing key(s) ['split']"),
    (lambda c: c["run"].update(seed="zero"), "run.seed must be an integer, got 'zero'"),
    (lambda c: c["run"].update(threads=0), "run.threads must be an integer >= 1, got 0"),
    (lambda c: c["run"].update(limit=True), "run.limit must be null or an integer >= 0"),
    (lambda c: c["model"]["weights"][0].update(sha=1), "model.weights[0]: unknown key(s) ['sha']"),
    (lambda c: c.update(format="v0"), f"format must be {FORMAT!r}, got 'v0'"),
])
def test_bad_config_is_refused_naming_the_key(run, tmp_path, capsys, edit, needle):
    d = _edited(run, tmp_path, edit)
    with pytest.raises(ValueError, match="config.yaml") as e:
        read_config(d)
    assert needle in str(e.value)
    assert main(["eval", "--from", d, "--out", str(tmp_path / "r")]) == 2
    assert needle in capsys.readouterr().err


def test_yaml_is_loaded_safely(run, tmp_path):
    """A python tag (what yaml.load would execute) is refused as unreadable YAML, never constructed."""
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    (copy / CONFIG_FILE).write_text("format: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(ValueError, match="not readable YAML"):
        read_config(copy)


def test_method_that_now_resolves_otherwise_is_refused(run, tmp_path, capsys):
    """The spec and files may be the same while the code's defaults moved: that is not a repeat."""
    d = _edited(run, tmp_path, lambda c: c["method"]["press"].update(window=999))
    assert main(["eval", "--from", d, "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "the run's method resolves otherwise than its config.yaml recorded (press.window: 999 -> " in err


@pytest.mark.parametrize("extra", [["--model", "x"], ["--seed", "1"], ["--method", "full", "--limit", "2"],
                                   ["--method-params", "{}"], ["--split", "s.jsonl"]])
def test_flags_that_conflict_with_from_are_refused(run, tmp_path, capsys, extra):
    assert main(["eval", "--from", str(run), "--out", str(tmp_path / "r"), *extra]) == 2
    err = capsys.readouterr().err
    assert "repeats the run recorded in its config.yaml, which sets" in err and extra[0] in err
    assert "only --out and --threads may be given with --from" in err and not (tmp_path / "r").exists()


def test_eval_without_from_still_needs_model_split_out(tmp_path, capsys):
    assert main(["eval", "--model", "x"]) == 2
    assert "required: --split, --out (or --from DIR" in capsys.readouterr().err


def test_from_a_directory_without_config(tmp_path, capsys):
    assert main(["eval", "--from", str(tmp_path)]) == 2
    assert "config.yaml not found: not a run directory of `kvbench eval`" in capsys.readouterr().err


def test_finished_run_of_other_arguments_is_refused_by_its_config(run, lm_dir, tmp_path):
    """The overwrite guard reads config.yaml's run section (before any model work)."""
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    with pytest.raises(ValueError, match=r"other arguments \(method: 'snapkv:keep=0.5' -> 'full'"):
        run_eval(lm_dir, _config(run)["run"]["split"], method="full", out_dir=copy, limit=3)


def test_legacy_run_without_config_is_still_guarded(lm_dir, tmp_path):
    """A run finished before config.yaml existed: its arguments are read from run_info.json's ``args``."""
    split = write_split(tmp_path / "t.jsonl", [text_record(0)])
    old = tmp_path / "old"
    old.mkdir()
    (old / "metrics.json").write_text("{}")
    (old / "run_info.json").write_text(json.dumps({"args": {
        "model_spec": str(lm_dir), "split_path": str(split), "method": "full", "out_dir": str(old), "seed": 0,
        "limit": None, "threads": 1, "method_params": {}, "device": "cpu"}}))
    with pytest.raises(ValueError, match=r"other arguments \(seed: 0 -> 1\)"):
        run_eval(lm_dir, split, out_dir=old, seed=1)


@pytest.fixture(scope="module")
def rkv_run(lm_dir, tmp_path_factory):
    """A finished 2-record ResidualKV run reading a (random) codec through ``--method-params``."""
    from kvbench.compress.residualkv.codec import ResidualCodec
    from kvbench.models.loader import load_model

    tmp = tmp_path_factory.mktemp("rkv")
    ResidualCodec.for_model(load_model(lm_dir)[0], seed=0).save(tmp / "codec")
    split = write_split(tmp / "test.jsonl", [text_record(i) for i in range(2)])
    out = tmp / "run"
    run_eval(lm_dir, split, method="residualkv+omnikv:full_layers=0+1,keep=0.2", out_dir=out,
             method_params={"codec_dir": str(tmp / "codec")})
    return out


def test_codec_is_recorded_and_checked(rkv_run, tmp_path, capsys):
    cfg = _config(rkv_run)
    codec = cfg["run"]["method_params"]["codec_dir"]
    assert cfg["method"]["press"]["class"] == "ResidualKVPress" and cfg["method"]["press"]["bits"] == 4
    assert [(f["file"], f["sha256"]) for f in cfg["inputs"]] == [
        (f"{codec}/{name}", sha256(f"{codec}/{name}")) for name in ("codec.json", "codec.safetensors")]
    assert main(["eval", "--from", str(rkv_run), "--out", str(tmp_path / "again")]) == 0
    for name in ("predictions.jsonl", "metrics.json"):
        assert (tmp_path / "again" / name).read_bytes() == (rkv_run / name).read_bytes(), name
    # the same codec directory with other weights is refused, naming the file and both hashes
    copy = tmp_path / "codec"
    shutil.copytree(codec, copy)
    d = _edited(rkv_run, tmp_path, lambda c: (c["run"]["method_params"].update(codec_dir=str(copy)),
                                              c["inputs"][1].update(file=str(copy / "codec.safetensors"))))
    w = copy / "codec.safetensors"
    w.write_bytes(w.read_bytes()[:-4] + b"\0\0\0\1")
    assert main(["eval", "--from", d, "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert f"method input {w} changed since the run: sha256 {sha256(w)}, recorded {cfg['inputs'][1]['sha256']}" in err


def test_the_file_hash_is_memoised_but_sees_a_rewritten_file(tmp_path):
    """A run hashes its split twice (identity and config.yaml): the second is a lookup, yet a file changed in
    place (new mtime) is hashed again."""
    import hashlib
    import os

    from kvbench.eval import runconfig

    f = tmp_path / "split.jsonl"
    f.write_text('{"id": 1}\n')
    assert runconfig.sha256(f) == hashlib.sha256(f.read_bytes()).hexdigest()
    hits = runconfig._sha256_of.cache_info().hits
    runconfig.sha256(f)
    assert runconfig._sha256_of.cache_info().hits == hits + 1
    st = f.stat()
    f.write_text('{"id": 2}\n')  # same size
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert runconfig.sha256(f) == hashlib.sha256(b'{"id": 2}\n').hexdigest()
