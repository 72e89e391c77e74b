"""ResidualKV codec training (paper §IV-D) on a tiny random Qwen2: the compressed pass, losses, resume."""
from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
import transformers

from kvbench.compress.cache import decoder_layers
from kvbench.compress.residualkv.codec import ResidualCodec
from kvbench.compress.residualkv.references import reference_mask
from kvbench.compress.residualkv.train import (
    TokenStream,
    compressed_forward,
    lr_at,
    ntp_loss,
    rec_loss,
    train_codec,
)
from kvbench.utils.steps import SliceEnded

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tok(request):
    """The zoo tokenizer (built offline by conftest)."""
    return request.getfixturevalue("tokenizer")


@pytest.fixture(scope="module")
def model(tok):
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=128, vocab_size=len(tok))
    model = transformers.Qwen2ForCausalLM(cfg).eval()  # head_dim 16 -> d_kv = 2 * 2 * 16 = 64
    # Real pre-RoPE K/V share a large per-channel offset (Qwen2's k/v biases, outlier channels);
    # a random init has none, and isotropic random residuals are nearly incompressible, so the
    # bias-free SwiGLU (quadratic near 0) cannot beat a zero code on them. Give the KV an offset.
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.bias.copy_(2 * torch.randn(32, generator=g))
            layer.self_attn.v_proj.bias.copy_(2 * torch.randn(32, generator=g))
    return model


def _ids(n: int = 40, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 500, (1, n), generator=torch.Generator().manual_seed(seed))


def _no_hooks(model) -> bool:
    return all(not getattr(l.self_attn, f"{p}_proj")._forward_hooks
               for l in decoder_layers(model) for p in ("k", "v"))


def test_stride_one_keeps_every_token_so_logits_equal_plain_model(model):
    codec = ResidualCodec.for_model(model, stride=1, n_sink=4)
    ids = _ids()
    logits, hat, teacher = compressed_forward(model, codec, ids)
    with torch.no_grad():
        plain = model(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(logits, plain)
    assert all(torch.equal(h, t) for h, t in zip(hat, teacher))
    assert _no_hooks(model)


def test_compressed_pass_keeps_sinks_and_refs_and_codes_the_rest(model):
    codec = ResidualCodec.for_model(model, seed=1, n_sink=4, stride=5)
    ids = _ids()
    logits, hat, teacher = compressed_forward(model, codec, ids)
    assert logits.shape == (1, 40, model.config.vocab_size)
    assert len(hat) == len(teacher) == 2 and hat[0].shape == teacher[0].shape == (1, 40, 64)
    pos = torch.arange(40)
    keep = reference_mask(pos, n_sink=4, stride=5) | (pos < 4)
    assert keep.sum() == 4 + 8  # sinks 0..3, references 4, 9, ..., 39
    # Layer 0 sees the same hidden states in both passes: kept tokens exact, coded ones changed.
    assert torch.equal(hat[0][0, keep], teacher[0][0, keep])
    assert (hat[0][0, ~keep] - teacher[0][0, ~keep]).abs().amax(-1).min() > 0
    # The teacher kv is the plain model's k_proj ‖ v_proj output.
    attn = decoder_layers(model)[0].self_attn
    with torch.no_grad():
        x = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
        torch.testing.assert_close(teacher[0], torch.cat([attn.k_proj(x), attn.v_proj(x)], -1))
    assert _no_hooks(model)


def test_gradient_reaches_codec_not_backbone(model):
    codec = ResidualCodec.for_model(model, n_sink=4, stride=5)
    for p in model.parameters():
        p.requires_grad_(False)
    try:
        ids = _ids()
        logits, hat, teacher = compressed_forward(model, codec, ids)
        (ntp_loss(logits, ids) + rec_loss(hat, teacher)).backward()
    finally:
        for p in model.parameters():
            p.requires_grad_(True)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in codec.parameters())
    assert all(p.grad is None for p in model.parameters())


def test_hooks_removed_after_an_exception(model):
    codec = ResidualCodec.for_model(model, n_sink=4, stride=5)

    def boom(*a, **k):
        raise RuntimeError("boom")

    codec.layers[1].residual_code = boom
    with pytest.raises(RuntimeError, match="boom"):
        compressed_forward(model, codec, _ids())
    assert _no_hooks(model)


def test_codec_must_fit_model(model):
    other = transformers.Qwen2Config(hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                     num_key_value_heads=2, intermediate_size=128, vocab_size=10)
    with pytest.raises(ValueError, match=r"codec \(n_layers=3, d_kv=64\) does not fit the model \(n_layers=2"):
        compressed_forward(model, ResidualCodec.for_model(other), _ids())


def test_losses_exact_values():
    logits = torch.zeros(1, 3, 5)
    assert ntp_loss(logits, torch.tensor([[0, 1, 2]])).item() == pytest.approx(torch.log(torch.tensor(5.0)).item())
    hat = [torch.ones(1, 2, 4), torch.zeros(1, 2, 4)]
    teacher = [torch.zeros(1, 2, 4), torch.full((1, 2, 4), 2.0)]
    assert rec_loss(hat, teacher).item() == pytest.approx(1.0 + 4.0)  # per-layer mean, summed over layers


def test_lr_schedule():
    # 100 steps: 2 warm-up steps, then linear decay to 0 over the remaining 98.
    assert [lr_at(s, 100, 1.0) for s in (0, 1, 2, 50, 99)] == pytest.approx([0.5, 1.0, 1.0, 50 / 98, 1 / 98])
    assert lr_at(0, 10, 2e-4) == pytest.approx(2e-4)  # warm-up rounds to at least one step


def test_token_stream_windows_are_packed_and_order_independent(tok):
    a = TokenStream(tok, "train", 64, seed=0)
    w3 = a.window(3)
    b = TokenStream(tok, "train", 64, seed=0)
    assert torch.equal(torch.cat([b.window(i) for i in range(4)], 1), torch.tensor([a.ids[:256]]))
    assert torch.equal(b.window(3), w3) and w3.shape == (1, 64)
    first_doc = tok(b.docs[b._order[0]], add_special_tokens=False)["input_ids"]
    assert b.ids[len(first_doc)] == tok.eos_token_id
    assert not torch.equal(TokenStream(tok, "train", 64, seed=1).window(0), a.window(0))


def _train(model, tok, out, **kw):
    codec = ResidualCodec.for_model(model, seed=0, n_sink=4, stride=5)
    args = {"out_dir": out, "objective": "mse", "steps": 4, "seq_len": 48, "lr": 5e-3,
            "log_every": 1, "eval_every": 2, "progress": False, **kw}
    return codec, train_codec(model, tok, codec, **args)


def test_training_lowers_rec_and_leaves_backbone_alone(model, tok, tmp_path):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    codec, summary = _train(model, tok, tmp_path / "run", steps=30, eval_every=30, lr=1e-2)
    assert summary["steps"] == 30
    assert summary["eval_final"]["eval_rec"] < 0.8 * summary["eval_before"]["eval_rec"]
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert all(p.requires_grad for p in model.parameters())  # flags restored after the call
    assert not model.training and _no_hooks(model)
    curves = pd.read_csv(tmp_path / "run" / "curves.csv")
    assert list(curves.columns) == ["step", "loss", "ntp", "rec", "lr", "eval_ntp", "eval_rec"]  # no wall-clock
    assert list(curves.step) == list(range(1, 31))
    assert curves[["ntp", "rec", "lr"]].notna().all().all()  # both terms logged under "mse"
    assert curves.eval_rec.notna().sum() == 1
    timing = pd.read_csv(tmp_path / "run" / "curves.timing.csv")
    assert list(timing.columns) == ["step", "elapsed_s"] and list(timing.step) == list(range(1, 31))
    assert timing.elapsed_s.is_monotonic_increasing
    assert not {"wall_s", "steps_per_s", "elapsed_s"} & set(summary)
    assert set(json.loads((tmp_path / "run" / "summary.timing.json").read_text())) == {"wall_s", "steps_per_s"}
    saved = ResidualCodec.load(tmp_path / "run" / "codec", model=model)
    assert all(torch.equal(a, b) for a, b in zip(saved.state_dict().values(), codec.state_dict().values()))
    assert summary["baseline_ntp"] > 0 and summary["n_val_windows"] == 4


FINAL_FILES = ("codec/codec.safetensors", "codec/codec.json", "curves.csv", "summary.json")


def test_sliced_run_gives_the_same_bytes_as_a_straight_one(model, tok, tmp_path):
    """Issue #11: a slice ends an invocation (state saved, SliceEnded, no final file), never the work; the
    resumed run's codec, curves and summary are byte-identical to an uninterrupted run's."""
    _train(model, tok, tmp_path / "full", objective="joint")
    for done in (1, 2):  # a slice that ends at once: one step per call (checked after each step)
        with pytest.raises(SliceEnded, match=f"after {done} of 4 steps; state saved in .*rerun"):
            _train(model, tok, tmp_path / "parts", objective="joint", slice_s=1e-9)
        assert json.loads((tmp_path / "parts" / "state" / "meta.json").read_text())["step"] == done
        assert not any((tmp_path / "parts" / f).exists() for f in (*FINAL_FILES, "curves.timing.csv"))
    _train(model, tok, tmp_path / "parts", objective="joint", slice_s=3600)  # a slice long enough: finishes
    for f in FINAL_FILES:
        assert (tmp_path / "full" / f).read_bytes() == (tmp_path / "parts" / f).read_bytes(), f
    with pytest.raises(ValueError, match=r"another configuration \(differs in \['lr'\]\)"):
        _train(model, tok, tmp_path / "parts", objective="joint", lr=1e-3)


def test_training_rng_comes_from_the_seed_not_the_caller(model, tok, tmp_path):
    """Bug: the state's RNG was the caller's global RNG at the first call, so a sliced run and a straight one
    started from different streams whenever the caller had drawn numbers in between (e.g. loading a model)."""
    states = []
    for i, caller_seed in enumerate((1, 2)):
        torch.manual_seed(caller_seed)
        before = torch.get_rng_state()
        _train(model, tok, tmp_path / str(i), steps=1)
        assert torch.equal(torch.get_rng_state(), before)  # the caller's RNG is left alone
        states.append(json.loads((tmp_path / str(i) / "state" / "meta.json").read_text())["rng"])
    assert states[0] == states[1] == torch.Generator().manual_seed(0).get_state().tolist()


def test_noop_resume_rewrites_the_same_summary(model, tok, tmp_path):
    """A rerun over a state already at ``steps`` (e.g. after Snakemake removed the outputs) writes the same
    codec and summary, with the last step's real losses."""
    _, first = _train(model, tok, tmp_path / "w")
    old = {f: (tmp_path / "w" / f).read_bytes() for f in FINAL_FILES}
    for f in FINAL_FILES:
        (tmp_path / "w" / f).unlink()
    _, again = _train(model, tok, tmp_path / "w")
    assert again == first and isinstance(again["final_loss"], float) and again["final_loss"] > 0
    assert {f: (tmp_path / "w" / f).read_bytes() for f in FINAL_FILES} == old


def test_bad_slice_is_refused(model, tok, tmp_path):
    with pytest.raises(ValueError, match="slice_s must be a positive number of seconds"):
        _train(model, tok, tmp_path / "a", slice_s=0)


def test_bad_objective(model, tok, tmp_path):
    with pytest.raises(ValueError, match="objective must be one of"):
        _train(model, tok, tmp_path, objective="kl")


def test_bad_seq_len_and_out_dir_are_named(model, tok, tmp_path):
    """Review findings: a window past the model's positions, and --out naming a file, ended in tracebacks."""
    max_pos = model.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"seq_len={max_pos + 1} exceeds the model's max_position_embeddings={max_pos}"):
        _train(model, tok, tmp_path / "a", seq_len=max_pos + 1)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        _train(model, tok, tmp_path / "file")


def test_task_stream_gives_answer_labels_and_is_deterministic(tokenizer):
    from kvbench.compress.residualkv.train import TaskStream

    a, b = TaskStream(tokenizer, "train", 128, 0), TaskStream(tokenizer, "train", 128, 0)
    ids, labels = a.batch(3)
    ids2, labels2 = b.batch(3)
    assert torch.equal(ids, ids2) and torch.equal(labels, labels2)
    assert ids.shape == labels.shape and (labels != -100).any()
    assert not torch.equal(a.batch(4)[0][:, :10], ids[:, :10]) or a.batch(4)[0].shape != ids.shape


def test_resume_with_another_codec_shape_is_refused_before_loading(model, tok, tmp_path):
    """Bug: a changed d_c crashed in load_state_dict with a size mismatch instead of naming the change."""
    with pytest.raises(SliceEnded):
        _train(model, tok, tmp_path / "w", slice_s=1e-9)
    codec = ResidualCodec.for_model(model, seed=0, n_sink=4, stride=5, d_c=8)
    with pytest.raises(ValueError, match=r"differs in \['codec', 'codec.d_c', 'codec.group'\]"):
        train_codec(model, tok, codec, out_dir=tmp_path / "w", objective="mse", steps=4, seq_len=48, lr=5e-3,
                    log_every=1, eval_every=2, progress=False)
