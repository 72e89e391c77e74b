"""Tiny configurations of the real transformers classes: the embedded default zoo.

Both models are built with the same classes a real checkpoint uses, from a
config only (no hub files), so every code path (attention interface, cache
classes, M-RoPE position ids, processor) is the real one:

- ``tiny-qwen2-lm``: ``Qwen2ForCausalLM``, 8 layers, d=128, 4 query / 2 KV heads
  (GQA, head_dim 32), tied embeddings (~1.6M parameters). The shape follows
  an earlier trial, where it was measured to learn induction-style retrieval on
  one CPU thread (docs/log.md, "2026-11 One-thread LM trial").
- ``tiny-qwen2-lm-chain``: the same class and shape, trained on the long chain tasks of ResidualKV Table V
  (:mod:`kvbench.data.chain`);
- ``tiny-qwen2.5-vl``: ``Qwen2_5_VLForConditionalGeneration`` with a real vision
  tower (14-px patches, 2x2 merge, window attention) and a 24-layer text model,
  d=96, 4 query / 2 KV heads, M-RoPE sections [4, 4, 4] (sum = head_dim/2),
  trained for the *strong* staleness regime (the instruction reaches the answer
  through the pages);
- ``tiny-qwen2.5-vl-mild``: the same model trained with another recipe (the mild
  staleness regime: the question side applies the serving instruction)
  (docs/decisions/zoo.md, "Two staleness regimes").
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from transformers import (
    PretrainedConfig,
    PreTrainedTokenizerBase,
    Qwen2_5_VLConfig,
    Qwen2Config,
    Qwen3Config,
)

#: Image-processor settings of the zoo VLM: 14-px patches merged 2x2, so one
#: visual token covers 28x28 px (one digit cell of the smoke pages).
VLM_IMAGE_PROCESSOR = dict(
    patch_size=14, merge_size=2, temporal_patch_size=2,
    min_pixels=28 * 28, max_pixels=28 * 28 * 256,
)


#: Weight init std of the zoo's text models. transformers' default (0.02, tuned
#: for d >= 1024) left d=128 models on the attention plateau: a random-offset
#: copy task was still at 1% accuracy after 450 steps, while with 0.08
#: (about 1/sqrt(d)) it passed 20% by step 340 (docs/decisions/zoo.md, "Initial weight scale").
INIT_RANGE = 0.08


#: Text model of the zoo VLMs: 24 layers, d = 96, 4 query / 2 KV heads (head_dim 24, M-RoPE sections [4, 4, 4]).
#: Why 24: CONDUIT's as-run CacheBlend/KVShare layer schedule (layer 0 = every visual token, then a linear decay
#: averaging ⌈r·N⌉) collapses onto layer 0 when ⌈r·N⌉·L <= N; the smoke pages have N = 8-24 visual tokens, so
#: r = 0.1 needs L >= 11 and r = 0.05 needs L >= 21 (docs/decisions/zoo.md, "Two staleness
#: regimes"). Narrower than the former 6-layer d = 128 model to stay inside the default profile's training budget.
VLM_TEXT = dict(
    hidden_size=96, intermediate_size=288, num_hidden_layers=24,
    num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=True,
    rope_scaling={"type": "mrope", "mrope_section": [4, 4, 4]}, initializer_range=INIT_RANGE,
)
VLM_VISION = dict(
    depth=2, hidden_size=64, intermediate_size=128, num_heads=2, in_channels=3,
    patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
    window_size=112, fullatt_block_indexes=[1],
)


@dataclass(frozen=True)
class ZooSpec:
    """One zoo entry: its name, family (``"lm"`` or ``"vlm"``), class name, the text (and vision) config
    fields, and the training recipe (:data:`kvbench.train.recipes.RECIPES`; ``""``: the family's)."""

    name: str
    kind: str
    architecture: str
    text: dict = field(default_factory=dict)
    vision: dict = field(default_factory=dict)
    recipe: str = ""

    @property
    def recipe_name(self) -> str:
        """The recipe this entry trains with: ``recipe`` when set, else its family's."""
        return self.recipe or self.kind


ZOO: dict[str, ZooSpec] = {
    "tiny-qwen2-lm": ZooSpec(
        name="tiny-qwen2-lm",
        kind="lm",
        architecture="Qwen2ForCausalLM",
        text=dict(
            hidden_size=128, intermediate_size=384, num_hidden_layers=8,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            max_position_embeddings=8192, rope_theta=10000.0, tie_word_embeddings=True,
            initializer_range=INIT_RANGE,
        ),
    ),
    "tiny-qwen2.5-vl": ZooSpec(
        name="tiny-qwen2.5-vl",
        kind="vlm",
        architecture="Qwen2_5_VLForConditionalGeneration",
        text=VLM_TEXT,
        vision=VLM_VISION,
    ),
}
# ResidualKV Table V's backbone: the LM's class and shape, trained on the long chain tasks
# (kvbench.train.recipes.chain_recipe). A separate entry: tiny-qwen2-lm's recipe hash feeds many tables.
# Qwen3ForCausalLM (as Qwen3-4B-Thinking) learned the chains about half as fast in the same recipe (its query/key
# norms), so the zoo backbone is a Qwen2 (docs/log.md, "2026-12-03 Table V chain model trials").
ZOO["tiny-qwen2-lm-chain"] = ZooSpec(
    name="tiny-qwen2-lm-chain", kind="lm", architecture="Qwen2ForCausalLM",
    text=dict(ZOO["tiny-qwen2-lm"].text), recipe="lm-chain")
# the same model trained for the mild staleness regime (kvbench.train.recipes.vlm_mild_recipe)
ZOO["tiny-qwen2.5-vl-mild"] = replace(ZOO["tiny-qwen2.5-vl"], name="tiny-qwen2.5-vl-mild", recipe="vlm-mild")


def seed_replica(name: str) -> tuple[str, int] | None:
    """``(entry, k)`` when ``name`` is ``<entry>-s<k>``, a seed replica of a :data:`ZOO` entry, else None.

    A replica is the entry's architecture and recipe trained from another seed (the config's
    ``models.<name>.zoo.seed``, which must be ``k``); the confirm profile trains ``tiny-qwen2.5-vl-s1`` and
    ``-s2`` beside the entry itself (seed 0) to see how much of a difference between two rows is the training seed's.
    """
    entry, sep, k = name.rpartition("-s")
    return (entry, int(k)) if sep and k.isdigit() and entry in ZOO and name not in ZOO else None


def zoo_spec(name: str) -> ZooSpec:
    """Look up a zoo entry, or the entry of a seed replica (:func:`seed_replica`). Raises ``KeyError`` naming the
    valid names."""
    replica = seed_replica(name)
    if replica is not None:
        return ZOO[replica[0]]
    if name not in ZOO:
        raise KeyError(f"unknown zoo model {name!r}; expected one of {sorted(ZOO)} or a seed replica "
                       f"<name>-s<k> of one")
    return ZOO[name]


def build_config(name: str, tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
    """The transformers config of zoo model ``name`` for ``tokenizer``'s vocabulary.

    Special-token ids (eos/pad, and the image/vision ids of the VLM) are taken
    from the tokenizer, so the checkpoint is self-consistent.
    """
    spec = zoo_spec(name)
    ids = dict(
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    if spec.kind == "lm":
        cls = Qwen3Config if spec.architecture == "Qwen3ForCausalLM" else Qwen2Config
        cfg = cls(**spec.text, **ids, attn_implementation="sdpa")
    else:
        tid = tokenizer.convert_tokens_to_ids
        cfg = Qwen2_5_VLConfig(
            text_config={**spec.text, **ids},
            vision_config={**spec.vision, "out_hidden_size": spec.text["hidden_size"]},
            image_token_id=tid("<|image_pad|>"),
            video_token_id=tid("<|video_pad|>"),
            vision_start_token_id=tid("<|vision_start|>"),
            vision_end_token_id=tid("<|vision_end|>"),
            tie_word_embeddings=True,
            initializer_range=INIT_RANGE,
            **ids,
        )
    cfg.architectures = [spec.architecture]
    return cfg


#: The zoo VLM's base-model prompt format: ``system + "\n" + user parts``, and each answer
#: follows the question directly and is closed by ``<|im_end|>\n``. No role headers sit
#: between a question and its answer, so the answer position holds the question's last
#: token: a model trained for minutes learns a one-hop lookup there but stayed at chance
#: when five template tokens separated them (docs/decisions/zoo.md, "The zoo VLM's prompt format").
#: Real checkpoints keep their own chat template.
VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['content'] is string %}{% set text = message['content'] %}"
    "{% else %}{% set ns = namespace(t='') %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{% set ns.t = ns.t + '<|vision_start|><|image_pad|><|vision_end|>' %}"
    "{% elif part['type'] == 'text' %}{% set ns.t = ns.t + part['text'] %}{% endif %}"
    "{% endfor %}{% set text = ns.t %}{% endif %}"
    "{% if message['role'] == 'system' %}{{ text }}\n"
    "{% elif message['role'] == 'assistant' %}{{ text }}<|im_end|>\n"
    "{% else %}{{ text }}{% endif %}"
    "{% endfor %}"
)


def build_processor(tokenizer: PreTrainedTokenizerBase):
    """The zoo VLM's real ``Qwen2_5_VLProcessor`` around the offline tokenizer.

    Uses ``Qwen2VLImageProcessor`` with :data:`VLM_IMAGE_PROCESSOR` (one visual
    token per 28x28 px) and the base-model prompt format
    :data:`VLM_CHAT_TEMPLATE` (set on the tokenizer too, so the saved
    checkpoint carries one template).
    """
    from transformers import (
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
    )

    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    return Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(**VLM_IMAGE_PROCESSOR),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(),
        chat_template=VLM_CHAT_TEMPLATE,
    )
