"""Attention supervision of the zoo LM's previous-token and induction heads (kvbench.train.heads)."""
from __future__ import annotations

import pytest
import torch
import transformers

from kvbench.models.tiny import build_config
from kvbench.train import heads


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
    from kvbench.train.recipes import apply_overrides, lm_recipe, phase_fields

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
    assert "head_layers" not in phase_fields(lm_recipe()[0])   # default: the trained models keep their hash
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
