"""Attention supervision of the zoo LM's previous-token and induction heads (kvbench.train.heads)."""
from __future__ import annotations

import pytest
import torch
import transformers

from kvbench.models.tiny import build_config
from kvbench.train import heads
from kvbench.train.recipes import Phase


def test_targets():
    ids = torch.tensor([[5, 7, 9, 5, 7, 5]])
    assert heads.previous_token_targets(ids).tolist() == [[-1, 0, 1, 2, 3, 4]]
    # position 3 (a 5) saw 5 at 0 -> attend to 1; position 5 (a 5) saw 5 last at 3 -> attend to 4
    assert heads.induction_targets(ids).tolist() == [[-1, -1, -1, 1, 2, 4]]


def test_supervision_leaves_the_forward_pass_unchanged_and_restores_sdpa(tokenizer):
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(build_config("tiny-qwen2-lm", tokenizer)).eval()
    ids = torch.randint(10, 200, (2, 24))
    ids[:, 12:] = ids[:, :12]
    mask = torch.ones_like(ids)
    ref = model(input_ids=ids, attention_mask=mask).logits
    with heads.supervise_heads(model):
        got = model(input_ids=ids, attention_mask=mask).logits
        loss = heads.head_supervision_loss(ids, mask)
    assert torch.allclose(got, ref, atol=1e-5)
    assert model.config._attn_implementation == "sdpa"
    # an untrained model attends near uniformly: each term is about log(number of visible positions)
    assert 1.0 < loss.item() < 2 * torch.log(torch.tensor(24.0)).item()
    loss.backward()
    layer, head = heads.PREVIOUS_TOKEN_HEAD
    assert model.model.layers[layer].self_attn.q_proj.weight.grad.abs().sum() > 0


def test_loss_without_a_forward_pass_is_an_error():
    with pytest.raises(RuntimeError, match="inside supervise_heads"):
        heads.head_supervision_loss(torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 4))


def test_head_layers_move_the_supervised_heads(tokenizer):
    """``head_layers`` (issue #32): the heads supervised sit in the layers named, so the supervision's gradient reaches
    the query projections up to the induction layer and none after it; a recipe field that the recipe hash leaves out
    at its default."""
    from kvbench.train.recipes import apply_overrides, copy_warmup, lm_recipe, phase_fields

    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(build_config("tiny-qwen2-lm", tokenizer))
    ids = torch.randint(10, 200, (1, 24))
    ids[:, 12:] = ids[:, :12]
    mask = torch.ones_like(ids)
    with heads.supervise_heads(model, layers=(3, 4)):
        model(input_ids=ids, attention_mask=mask)
        heads.head_supervision_loss(ids, mask).backward()
    grads = [layer.self_attn.q_proj.weight.grad for layer in model.model.layers]
    assert [i for i, g in enumerate(grads) if g is not None and g.abs().sum() > 0] == [0, 1, 2, 3, 4]
    for bad in [(1, 1), (4, 3), (0, 8)]:
        with pytest.raises(ValueError, match="head_layers must be"):
            with heads.supervise_heads(model, layers=bad):
                pass
    moved = apply_overrides(lm_recipe(), {"phases": {"copy32": {"head_layers": [3, 4]}}})
    assert moved[0].head_layers == (3, 4) and phase_fields(moved[0])["head_layers"] == (3, 4)
    assert "head_layers" not in phase_fields(copy_warmup())   # default: the trained models keep their hash
    with pytest.raises(ValueError, match="head_layers must be two layer indices"):
        apply_overrides(lm_recipe(), {"phases": {"copy32": {"head_layers": [2]}}})


def test_head_layers_outside_the_model_are_refused_before_training(tokenizer_dir, tmp_path):
    """A later phase's head_layers past the model's 8 layers fails before the first step, naming the phase
    (it failed only when that phase started, after the earlier phases had trained)."""
    from kvbench.train.zoo import train_zoo_model

    with pytest.raises(ValueError, match=r"phase 'tasks1024': head_layers \(0, 9\) names layer 9, but the model has 8"):
        train_zoo_model("tiny-qwen2-lm", tokenizer_dir=tokenizer_dir, out_dir=tmp_path / "out",
                        workdir=tmp_path / "work", overrides={"phases": {"tasks1024": {"head_layers": [0, 9]}}})
    assert not (tmp_path / "work" / "state").exists()


IDENTITY = [Phase("held", "copy", steps=3, lr=3e-3, warmup=1, batch=2, seq_len=32, head_supervision=1.0,
                  head_layers=(0, 2), identity_layers=(1,)),
            Phase("free", "copy", steps=3, lr=3e-3, warmup=1, batch=2, seq_len=32, head_supervision=1.0,
                  head_layers=(0, 2))]


def _skipping(model, layer):
    """``model``'s logits with decoder ``layer`` removed (its output replaced by its input)."""
    hook = model.model.layers[layer].register_forward_hook(lambda m, args, kwargs, out: (args[0],) + tuple(out[1:])
                                                           if isinstance(out, tuple) else args[0], with_kwargs=True)
    return hook


def test_identity_layers_hold_a_layer_as_an_identity_block_then_train_it(tokenizer, tmp_path):
    """``identity_layers`` (issue #32, item 4): during the phase the layer adds nothing (logits equal the model
    without it) and none of its weights move; the next phase trains it from there."""
    from kvbench.train.loop import run_phases

    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(build_config("tiny-qwen2-lm", tokenizer))
    before = [p.detach().clone() for p in model.model.layers[1].parameters()]
    run_phases(model, tokenizer, IDENTITY[:1], tmp_path / "held", seed=0)
    layer = model.model.layers[1]
    assert layer.self_attn.o_proj.weight.abs().sum() == 0 and layer.mlp.down_proj.weight.abs().sum() == 0
    for (name, p), b in zip(layer.named_parameters(), before):
        if not name.endswith(("o_proj.weight", "down_proj.weight")):
            assert torch.equal(p, b), name
    ids = torch.randint(10, 200, (1, 20))
    model.eval()
    got = model(input_ids=ids).logits
    hook = _skipping(model, 1)
    try:
        ref = model(input_ids=ids).logits
    finally:
        hook.remove()
    assert torch.equal(got, ref)
    assert model.model.layers[0].self_attn.q_proj.weight.requires_grad is True

    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(build_config("tiny-qwen2-lm", tokenizer))
    run_phases(model, tokenizer, IDENTITY, tmp_path / "both", seed=0)
    assert model.model.layers[1].self_attn.o_proj.weight.abs().sum() > 0
    assert all(p.requires_grad for p in model.parameters())


def test_identity_layers_resume_in_a_later_phase_exactly(tokenizer, tmp_path):
    """A run cut inside the phase after the identity phase resumes to the uninterrupted run's weights: the held
    layer is zeroed only when its phase is not finished (zeroing it again on resume would wipe what the later
    phase trained)."""
    from kvbench.train.loop import run_phases
    from kvbench.utils.steps import SliceEnded

    torch.manual_seed(0)
    ref = transformers.Qwen2ForCausalLM(build_config("tiny-qwen2-lm", tokenizer))
    run_phases(ref, tokenizer, IDENTITY, tmp_path / "ref", seed=0)
    torch.manual_seed(0)
    cut = transformers.Qwen2ForCausalLM(build_config("tiny-qwen2-lm", tokenizer))
    with pytest.raises(SliceEnded):
        run_phases(cut, tokenizer, IDENTITY, tmp_path / "cut", seed=0, max_steps=5)
    torch.manual_seed(1)
    resumed = transformers.Qwen2ForCausalLM(build_config("tiny-qwen2-lm", tokenizer))
    run_phases(resumed, tokenizer, IDENTITY, tmp_path / "cut", seed=0)
    for a, b in zip(ref.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_identity_layers_bad_values_are_refused(tokenizer_dir, tmp_path):
    from kvbench.train.recipes import apply_overrides, copy_warmup, lm_recipe, phase_fields
    from kvbench.train.zoo import train_zoo_model

    for bad in ([-1], [1, 1], ["1"], [True], 1):
        with pytest.raises(ValueError, match="identity_layers must be distinct layer indices"):
            apply_overrides(lm_recipe(), {"phases": {"tasks64": {"identity_layers": bad}}})
    with pytest.raises(ValueError, match=r"supervised head's layer \[2\] cannot be an identity layer"):
        apply_overrides(lm_recipe(), {"phases": {"tasks64": {"identity_layers": [2]}}})
    with pytest.raises(ValueError, match=r"phase 'tasks64': identity_layers \(1, 8\) names layer 8, but the model has 8"):
        train_zoo_model("tiny-qwen2-lm", tokenizer_dir=tokenizer_dir, out_dir=tmp_path / "out",
                        workdir=tmp_path / "work", overrides={"phases": {"tasks64": {"identity_layers": [1, 8]}}})
    assert not (tmp_path / "work" / "state").exists()
    # a later field: left out of the hash at its default (the chain model keeps its directory), in it when set
    assert "identity_layers" not in phase_fields(copy_warmup())
    assert phase_fields(lm_recipe()[0])["identity_layers"] == (1,)


def test_a_bad_mixture_entry_is_refused_before_training(tokenizer_dir, tmp_path):
    """Review finding (issue #32): a bad generator parameter in a later phase's mixture (``value_tokens: 0`` at
    tasks1024) failed only when that phase started, about 880 steps in; it is refused before the first step."""
    from kvbench.train.zoo import train_zoo_model

    for entry, needle in ((["niah", 1.0, {"value_tokens": 0}], "value_tokens must be an integer >= 1, got 0"),
                          (["needle", 1.0, {}], "unknown task family 'needle'"),
                          (["kv", 0, {}], "weight must be a number > 0, got 0")):
        with pytest.raises(ValueError, match=r"phase 'tasks1024': mixture entry 0 .*" + needle):
            train_zoo_model("tiny-qwen2-lm", tokenizer_dir=tokenizer_dir, out_dir=tmp_path / "out",
                            workdir=tmp_path / "work", overrides={"phases": {"tasks1024": {"mixture": [entry]}}})
        assert not (tmp_path / "work" / "state").exists()
