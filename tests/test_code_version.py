"""The recipe hash pins the code that makes an artefact (issue #33, item 3): a change to what training runs renames
every zoo model, a docstring or comment change does not, and a zoo model trains to the same bytes twice, once beside
CPU-bound processes."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvbench
from kvbench.utils import recipe as recipe_mod
from kvbench.utils.recipe import code_version, recipe_hash, source_modules


@pytest.fixture
def package_copy(tmp_path, monkeypatch):
    """A copy of the kvbench sources that the digest reads instead of the installed ones."""
    src = Path(kvbench.__file__).parent
    dst = tmp_path / "kvbench"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(recipe_mod, "_PACKAGE", dst)
    source_modules.cache_clear()
    yield dst
    source_modules.cache_clear()


def _zoo_hash(name="tiny-qwen2.5-vl", kind="vlm"):
    from kvbench.train.recipes import zoo_recipe

    source_modules.cache_clear()
    return recipe_hash(zoo_recipe(name, kind, {}, seed=0, threads=2, tokenizer="t"))


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new, 1))


def test_the_training_closure_holds_what_decides_the_weights_and_nothing_downstream():
    mods = source_modules("kvbench.train.zoo")
    for needed in ("kvbench.train.loop", "kvbench.train.batches", "kvbench.train.heads", "kvbench.train.recipes",
                   "kvbench.models.tiny", "kvbench.data.docpages", "kvbench.data.longctx", "kvbench.train",
                   "kvbench"):
        assert needed in mods
    assert not any(m.startswith(("kvbench.reuse", "kvbench.report", "kvbench.compress", "kvbench.eval"))
                   for m in mods)


def test_a_training_code_change_renames_the_zoo_models(package_copy):
    before = {m: _zoo_hash(m, k) for m, k in (("tiny-qwen2.5-vl", "vlm"), ("tiny-qwen2-lm", "lm"))}
    # a change that alters training: the cosine floor of the learning-rate schedule
    _edit(package_copy / "train" / "loop.py", "0.1", "0.2")
    after = {m: _zoo_hash(m, k) for m in before for k in [("vlm" if "vl" in m else "lm")]}
    assert all(after[m] != before[m] for m in before)


def test_a_data_generator_change_renames_the_zoo_models(package_copy):
    before = _zoo_hash()
    _edit(package_copy / "data" / "docpages.py", "def ", "def _unused():\n    return 1\n\n\ndef ")
    assert _zoo_hash() != before


def test_docstrings_comments_and_code_outside_training_keep_the_hash(package_copy):
    before = _zoo_hash()
    loop = package_copy / "train" / "loop.py"
    text = loop.read_text()
    first_doc = text.index('"""')
    loop.write_text(text[:first_doc + 3] + "Reworded. " + text[first_doc + 3:] + "\n# a comment\n")
    report = next((package_copy / "report").glob("*.py"))
    report.write_text(report.read_text() + "\nX = 1\n")
    assert _zoo_hash() == before


def test_code_version_names_the_libraries_and_refuses_an_unknown_module():
    v = code_version("kvbench.train.zoo")
    assert set(v) >= {"sources", "python", "torch", "transformers"} and len(v["sources"]) == 16
    with pytest.raises(ValueError, match="no kvbench module named 'kvbench.train.zooo'"):
        code_version("kvbench.train.zooo")


def test_tokenizer_and_split_hashes_carry_the_code(monkeypatch):
    import yaml
    from snakemake.utils import validate

    from kvbench.plan import workspace as ws_mod
    from test_workflow import CONFIG, REPO

    cfg = yaml.safe_load(CONFIG.read_text())
    validate(cfg, str(REPO / "workflow" / "schemas" / "config.schema.yaml"))  # the Snakefile's defaults
    a = ws_mod.Workspace(cfg)
    monkeypatch.setattr(ws_mod, "code_version", lambda root: {"sources": "changed"})
    b = ws_mod.Workspace(cfg)
    assert a.tokenizer_hash != b.tokenizer_hash
    assert all(a.data_hashes[t] != b.data_hashes[t] for t in a.data_hashes)
    assert all(a.zoo_hashes[m] != b.zoo_hashes[m] for m in a.zoo_hashes)  # through the tokenizer hash


def test_another_cpu_instruction_set_renames_the_zoo_models():
    """ATen's vector instruction set changes the trained bytes (an AVX2 and an AVX-512 machine gave two strong zoo
    VLMs), so it is part of the hash: a process with ``ATEN_CPU_CAPABILITY=default`` (no vector kernels) names the
    zoo VLM differently. The training summary records the CPU it trained on."""
    here = code_version("kvbench.train.zoo")["cpu"]
    assert here["aten"] == torch.backends.cpu.get_cpu_capability() and here["machine"]
    probe = ("import json; from kvbench.utils.recipe import recipe_hash, code_version; "
             "from kvbench.train.recipes import zoo_recipe; "
             "print(json.dumps([code_version('kvbench.train.zoo')['cpu']['aten'], "
             "recipe_hash(zoo_recipe('tiny-qwen2.5-vl', 'vlm', {}, seed=0, threads=2, tokenizer='t'))]))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                         env={**os.environ, "ATEN_CPU_CAPABILITY": "default"})
    aten, other = json.loads(out.stdout)
    assert aten == "DEFAULT" and here["aten"] != "DEFAULT"
    assert other != _zoo_hash()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("name", ["tiny-qwen2-lm", "tiny-qwen2.5-vl", "tiny-qwen2.5-vl-mild", "tiny-qwen2-lm-chain"])
def test_a_zoo_model_trains_to_the_same_bytes_beside_cpu_bound_processes(name, tokenizer_dir, tmp_path):
    """Every phase of the model's recipe, one step each (``steps_scale``), trained twice: once as it comes, once
    beside two busy-looping processes. The weights file is byte-identical: training counts steps, never time."""
    from kvbench.train.zoo import train_zoo_model

    def train(tag):
        return train_zoo_model(name, tokenizer_dir=tokenizer_dir, out_dir=tmp_path / tag / "model",
                               workdir=tmp_path / tag / "work", seed=0, threads=2, overrides={"steps_scale": 1e-9})

    train("quiet")
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        train("loaded")
    finally:
        for p in busy:
            p.kill()
            p.wait()
    files = [tmp_path / t / "model" / "model.safetensors" for t in ("quiet", "loaded")]
    assert _sha256(files[0]) == _sha256(files[1])
