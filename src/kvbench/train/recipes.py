"""Training recipes of the zoo: phases of steps, each a data mixture at one length.

Recipes are counted in optimiser steps, not seconds, so a run is a function of
its seed alone (``--slice-s`` only ends one invocation; a rerun resumes).
The LM recipe follows an earlier measured trial (docs/decisions/zoo.md, "The LM recipe"):
induction heads form on a random-offset copy task at 32 tokens (lr 3e-3),
helped by supervising where a previous-token and an induction head attend
(:mod:`kvbench.train.heads`), then the context length is raised gradually
(64 -> 1,024 tokens, lr 1e-3, cosine) because a jump straight to long contexts
destroyed the circuit, and accuracy only appears at lengths that were trained. The VLM recipe first trains the vision tower
as a digit-cell classifier (a stand-in for a pretrained vision tower, as in
the staleness trial, docs/decisions/zoo.md, "The VLM recipe"), then the whole model on the VLM tasks, with a
per-cell reading term and the prompt text hidden from the question side
(:mod:`kvbench.train.readthrough`), so that the instruction is applied while
the pages are read.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace

from kvbench.utils.recipe import code_version


@dataclass(frozen=True)
class Phase:
    """One training phase.

    Parameters
    ----------
    name : str — label in curves.csv.
    kind : str — ``"copy"`` (random-offset copy), ``"tasks"`` (smoke task mixture)
        or ``"vision_probe"`` (vision tower as a digit classifier).
    steps : int — optimiser steps.
    lr : float — peak learning rate; linear warm-up then cosine to ``lr * 0.1``.
    warmup : int — warm-up steps.
    batch : int — sequences (or pages) per step.
    seq_len : int — target tokens per sequence (``copy``/text tasks).
    copy_vocab : int — ``copy`` draws its tokens from this many lexicon tokens
        (0: the whole vocabulary).
    restrict_softmax : bool — ``copy`` only: the loss's softmax runs over the
        ``copy_vocab`` tokens alone, as in a model whose vocabulary is that small
        (the earlier trial, docs/log.md, "2026-11 One-thread LM trial", had 512 tokens). Measured here:
        induction accuracy rose about 3x faster than with the softmax over all
        4,096 tokens (docs/log.md, "2026-11-30 Recipe sweep on a lent H200").
    decay : bool — cosine-decay the learning rate after warm-up (else constant).
    freeze_vision : bool — from this phase on, the VLM's vision tower is frozen
        (as the staleness trial froze its pre-trained digit encoder). Trained
        jointly, the probe-trained features were lost and the language side
        stayed at chance; frozen, digitgrid reached 92% (docs/log.md,
        "2026-11-30 Recipe sweep on a lent H200").
    head_supervision : float — weight of the attention-supervision term
        (:mod:`kvbench.train.heads`: a previous-token head and an induction head)
        added to the loss; 0 turns it off. Text models only.
    head_layers : tuple — ``(previous-token head's layer, induction head's layer)`` of the supervised heads
        (query head 0 of each; the skip head is head 1 of the induction layer); default ``(0, 1)``. Where the
        induction head sits decides which layer's keys retrieval reads (issue #32: the layers a compressed cache
        keeps full or compresses). A phase field like the others: to move the heads for a whole run, set it in
        every phase (``overrides = {"phases": {name: {"head_layers": [1, 2], "identity_layers": []} for every phase
        name}}``; the zoo LM's recipe holds layer 1 as an identity block, so moving a head there clears that too).
    identity_layers : tuple — decoder layers held as identity blocks during this phase (LLaMA Pro's block
        expansion, Wu et al. 2024, §3: output projections at zero): the layer's attention ``o_proj`` and MLP
        ``down_proj`` weights are set to zero when the phase starts and the whole layer gets no update, so it adds
        nothing to the residual stream; a later phase without it trains the layer from there. Default ``()``.
        The zoo LM holds layer 1 so that its induction head forms in layer 2, past the layers ResidualKV keeps
        full (issue #32, item 4; docs/decisions/zoo.md, "Retrieval past the full layers").
    skip_supervision : float — weight of the skip head's attention-supervision term (:data:`kvbench.train.heads.SKIP_HEAD`:
        the induction lookup of the token before the current one, which the chain-pairs task's alternation needs);
        0 turns it off. Needs ``head_supervision``.
    cell_reading : float — weight of the per-cell reading term: at every visual
        token of a docpages/digitgrid page, the LM head must predict that cell's
        answer under the request's instruction (the instruction applied to the
        cell's digit). It makes the instruction-dependent work happen at the image
        positions, as it does in the staleness trial and in real VLMs, so that a
        page cached under another prefix is measurably stale (issue #3, item 9;
        docs/decisions/zoo.md, "Per-cell reading term and hidden prompt"). 0 turns it off. VLMs only.
    cell_target : str — what the per-cell reading term asks of a visual token: ``"instruction"``
        (the cell's answer under the request's instruction: the instruction is applied while the page
        is read, the *strong* staleness regime) or ``"content"`` (the digit as written, whatever the
        instruction: the page's tokens encode content and the question side applies the instruction,
        the *mild* regime; docs/decisions/zoo.md, "Two staleness regimes").
    hide_prompt : str — training-time attention mask (:mod:`kvbench.train.readthrough`):
        ``""`` none, ``"prefix"`` or ``"text"``: the tokens after the last page
        do not see the prompt text, so the instruction reaches the answer only
        through the pages. VLMs only.
    stale_pages : float — share (0..1) of the VLM records trained as stale-page records
        (:func:`kvbench.train.batches.stale_page_record`): a decoy instruction the question side sees
        but must not follow, hidden from the pages. Needs ``hide_prompt``; 0 turns it off.
    mixture : tuple — ``(family, weight, params)`` triples for ``tasks`` phases;
        ``params`` go to :func:`kvbench.data.smoke.sample`.
    """

    name: str
    kind: str
    steps: int
    lr: float
    warmup: int = 20
    batch: int = 8
    seq_len: int = 0
    copy_vocab: int = 0
    restrict_softmax: bool = False
    decay: bool = True
    freeze_vision: bool = False
    head_supervision: float = 0.0
    skip_supervision: float = 0.0
    head_layers: tuple = (0, 1)
    identity_layers: tuple = ()
    cell_reading: float = 0.0
    cell_target: str = "instruction"
    hide_prompt: str = ""
    stale_pages: float = 0.0
    mixture: tuple = field(default_factory=tuple)


def lm_task_mixture(seq_len: int) -> tuple:
    """The smoke-task mixture the zoo LM trains on at ``seq_len`` tokens (also the ResidualKV codec's
    training text, :class:`kvbench.compress.residualkv.train.TaskStream`).

    Returns ``(family, weight, params)`` triples (:attr:`Phase.mixture`): needle-in-a-haystack with one-token and
    with four-token values (``value_tokens``: answered over four decode steps, issue #32, item 3), KV retrieval,
    variable tracking and code completion, each record ``seq_len`` tokens long; needle and KV query
    counts grow with the length up to a cap (4 and 48).
    """
    q = max(2, min(16, seq_len // 64))
    # Three times as many KV queries as needle queries per sequence: with 16 at 1k, KV retrieval
    # reached 0.10 after the 512-token phase, with 48 (and the lexicon-wide copy) 0.40.
    niah = {"length_tokens": seq_len, "n_queries": min(4, q)}
    kv = {"length_tokens": seq_len, "n_queries": min(48, 3 * q)}
    return (
        ("niah", 1.0, niah),
        ("kv", 1.5, kv),
        ("niah", 0.5, niah | {"value_tokens": 4}),
        ("vt", 0.5, {"length_tokens": seq_len, "n_queries": 1}),
        ("lcc", 0.1, {"length_tokens": seq_len, "n_queries": 1, "full_loss": True}),
    )


#: ``(seq_len, steps, batch)`` of the LM's task phases after the copy warm-up.
LM_LENGTHS = ((64, 100, 16), (128, 100, 8), (256, 100, 8), (512, 180, 4), (1024, 380, 2))


def copy_warmup(**fields) -> Phase:
    """The zoo LMs' first phase: random-offset copy at 32 tokens with supervised heads (``fields`` replace
    :class:`Phase` fields; the chain model keeps the defaults, heads at layers 0 and 1)."""
    # The copy tokens are the whole key/value lexicon (1,626 tokens), so that every key's
    # embedding is trained before the retrieval tasks; the softmax runs over them alone.
    return replace(Phase("copy32", "copy", steps=400, lr=3e-3, warmup=30, batch=16, seq_len=32, copy_vocab=1626,
                         restrict_softmax=True, decay=False, head_supervision=1.0), **fields)


#: ``(previous-token head's layer, induction head's layer)`` of the zoo LM, and the layer held as an identity
#: block until the last phase: the induction head forms in layer 2, the first layer ResidualKV compresses
#: (its recipe keeps layers 0-1 full), with the previous-token head's output reaching it unchanged.
LM_HEAD_LAYERS, LM_IDENTITY_LAYERS = (0, 2), (1,)


def lm_recipe() -> list[Phase]:
    """Phases of ``tiny-qwen2-lm``: copy warm-up at 32 tokens, then 64 -> 1,024-token task mixtures.

    Every phase supervises a previous-token head (layer 0) and an induction head (layer 2)
    (:mod:`kvbench.train.heads`); without that the circuit had not formed within the CPU budget. Layer 1 is
    an identity block (:attr:`Phase.identity_layers`) until the 1,024-token phase, which trains every layer:
    trained from the start with the heads at (0, 2) or (1, 2), retrieval stayed far below the floor
    (docs/decisions/zoo.md, "Retrieval past the full layers"). Batches are small (2,048 tokens or fewer) so
    that the run reaches the 1k-token phase inside the 840 s cap on 2 cores: on the plateau the number of
    steps, not tokens, is what counted (docs/log.md, "2026-11-30 Main command at cdf748e").
    """
    heads = {"head_supervision": 1.0, "head_layers": LM_HEAD_LAYERS}
    phases = [copy_warmup(identity_layers=LM_IDENTITY_LAYERS, **heads)]
    for seq_len, steps, batch in LM_LENGTHS:
        held = LM_IDENTITY_LAYERS if seq_len < LM_LENGTHS[-1][0] else ()
        phases.append(Phase(f"tasks{seq_len}", "tasks", steps=steps, lr=1e-3, warmup=10, batch=batch,
                            seq_len=seq_len, mixture=lm_task_mixture(seq_len), identity_layers=held, **heads))
    return phases


def vlm_recipe() -> list[Phase]:
    """Phases of ``tiny-qwen2.5-vl`` (1,950 steps), the *strong* staleness regime: the prompt text is hidden from
    the question side and half the records carry a decoy instruction, so the instruction reaches the answer
    through the pages."""
    # Cell lookup is learned on one image first (digitgrid), then across pages, with the
    # probe-trained vision tower frozen as a stand-in for a pretrained one. The per-cell reading
    # term and the hidden prompt make the instruction reach the answer through the pages, so a
    # page cached under another prefix is stale (docs/decisions/zoo.md, "Per-cell reading term and hidden prompt").
    grid = (("digitgrid", 1.0, {"n_queries": 8}),)
    mix = (("docpages", 1.0, {"n_queries": 8}), ("digitgrid", 0.3, {"n_queries": 8}))
    # Half the records are stale-page records (a decoy instruction the question side sees and must not
    # follow): without them a 24-layer model read the serving instruction from the prompt text at evaluation
    # and reuse scored as full prefill (docs/log.md, "2026-12-02 A deeper zoo VLM").
    read = {"freeze_vision": True, "cell_reading": 1.0, "hide_prompt": "text", "stale_pages": 0.5}
    return [
        Phase("vision_probe", "vision_probe", steps=150, lr=3e-3, warmup=10, batch=16),
        # The one-page lookup broke through about 600 steps into this phase (with the reading
        # term alone, about 1,050 steps after the probe); a shorter phase ended on the plateau.
        Phase("grid", "tasks", steps=800, lr=2e-3, warmup=20, batch=8, mixture=grid, **read),
        Phase("tasks", "tasks", steps=1000, lr=1.5e-3, warmup=20, batch=8, mixture=mix, **read),
    ]


def vlm_mild_recipe() -> list[Phase]:
    """Phases of ``tiny-qwen2.5-vl-mild``: :func:`vlm_recipe`'s steps, data and learning rates, but each visual
    token is trained to read its cell's digit as written (``cell_target="content"``) and the question side sees
    the prompt (no ``hide_prompt``), so the instruction in the serving prefix is applied where the question is
    answered and a page's K/V depend on the prefix only through ordinary attention, as in real VLMs (the mild
    staleness regime, CONDUIT issue #15; docs/decisions/zoo.md, "Two staleness regimes")."""
    mild = {"cell_target": "content", "hide_prompt": "", "stale_pages": 0.0}
    return [replace(p, **mild) if p.kind == "tasks" else p for p in vlm_recipe()]


def vlm_dial_recipe(stale_pages: float) -> list[Phase]:
    """Phases of a point on the staleness dial (CONDUIT issue #33; docs/decisions/zoo.md, "The staleness dial"):
    :func:`vlm_recipe`'s steps, data and learning rates, each visual token trained to read its cell as written
    (``cell_target="content"``, as the mild regime), the prompt hidden from the question side (``hide_prompt="text"``,
    as the strong one) and ``stale_pages`` of the task records carrying a decoy instruction. The screen
    (``scripts/conduit_dial_screen.py``) trains exactly these phases through ``kvbench train --overrides``."""
    return [replace(p, **dial_fields(stale_pages)) if p.kind == "tasks" else p for p in vlm_recipe()]


def dial_fields(stale_pages: float) -> dict:
    """The :class:`Phase` fields a point on the staleness dial sets in every task phase (:func:`vlm_dial_recipe`)."""
    return {"cell_target": "content", "hide_prompt": "text", "stale_pages": stale_pages}


#: ``(max hops, steps, batch)`` of the chain model's plain-chain phases after the copy warm-up: chains of
#: ``max hops // 2 .. max hops`` variables, one distractor chain, every chain asked (:func:`kvbench.data.chain.sample_chain`)
CHAIN_LENGTHS = ((8, 300, 16), (32, 300, 8))
#: ``(max hops, steps, batch)`` of its chain-pairs phases that follow: two chains of ``max hops // 2 .. max hops``
#: variables written in alternation, then four asks (:func:`kvbench.data.chain.sample_chain_pairs`)
PAIRS_LENGTHS = ((8, 300, 16), (32, 250, 4), (64, 1700, 2))
#: ``(max hops, steps, batch)`` of the last phase: :data:`PAIRS_LENGTHS`'s last, its learning rate cosine-decayed
#: to a tenth (warm-up of one step: it continues at the rate the phase before ended on)
PAIRS_ANNEAL = (64, 400, 2)


def chain_recipe() -> list[Phase]:
    """Phases of ``tiny-qwen2-lm-chain`` (ResidualKV Table V's smoke backbone): :func:`copy_warmup`
    (induction heads, supervised), then plain chains (each hop an induction lookup in the prompt), then chain pairs
    (each step a lookup keyed by the token two back, the final answer an induction lookup on the generated trace),
    heads supervised throughout and the skip head from the pairs phases on.

    The learning rate stays at 1e-3 in every chain phase but the last (no decay): with each 150-step phase decayed to
    1e-4 the first trial stayed at chance; constant, the plain chains reached 86% token accuracy at 32 hops and the
    pairs 97% at 64, a plateau at which only 0.40 of the 64-hop final answers were right. The last phase,
    ``pairs64_anneal`` (:data:`PAIRS_ANNEAL`), continues pairs64 with the rate cosine-decayed 1e-3 -> 1e-4, the usual
    end of a constant-rate run; with it the final answers reached 0.95 (docs/log.md, "2026-12-03 Table V chain
    model trials"). The phases before it are constant, so a longer phase continues a shorter one's state
    exactly (how the trials extended pairs64 and then appended the anneal).
    """
    phases = [copy_warmup()]
    for hops, steps, batch in CHAIN_LENGTHS:
        mix = (("chain", 1.0, {"hops": hops, "min_hops": max(1, hops // 2), "n_distractors": 1}),)
        phases.append(Phase(f"chain{hops}", "tasks", steps=steps, lr=1e-3, warmup=10, batch=batch, seq_len=0,
                            mixture=mix, head_supervision=1.0, decay=False))
    for hops, steps, batch in PAIRS_LENGTHS:
        mix = (("chain_pairs", 1.0, {"hops": hops, "min_hops": max(1, hops // 2), "n_asks": 4}),)
        phases.append(Phase(f"pairs{hops}", "tasks", steps=steps, lr=1e-3, warmup=10, batch=batch, seq_len=0,
                            mixture=mix, head_supervision=1.0, skip_supervision=1.0, decay=False))
    hops, steps, batch = PAIRS_ANNEAL
    phases.append(replace(phases[-1], name=f"pairs{hops}_anneal", steps=steps, batch=batch, warmup=1, decay=True))
    return phases


#: the module that trains a zoo model (``kvbench train``): the code digest of a zoo recipe starts here
TRAINING_ENTRY = "kvbench.train.zoo"
RECIPES = {"lm": lm_recipe, "vlm": vlm_recipe, "vlm-mild": vlm_mild_recipe, "lm-chain": chain_recipe}
#: recipe name -> the last phase a seed replica shares with its entry ("shared warm-up phases", issue #33, item 2).
#: A replica ``<entry>-s<k>`` of such a recipe starts from the state the entry saved at the end of that phase
#: (``warmup/`` in the entry's work directory: weights, probe head, AdamW moments, after the entry's seed drew the
#: batches) and draws the batches of every later phase from its own seed. The VLM recipes share the vision probe and
#: the one-page grid phase (950 of 1,950 steps), so seeds differ in how the multi-page task phase, where the staleness
#: regime is learned, is trained, and a replica costs its 1,000 task steps (docs/decisions/conduit.md, "Profiles and
#: cost"). Recipes not named here train every replica from its own seed from step 0.
SHARED_WARMUP = {"vlm": "grid", "vlm-mild": "grid"}
#: values of :attr:`Phase.cell_target`
CELL_TARGETS = ("instruction", "content")


def warmup_steps(recipe_name: str, phases: list[Phase]) -> int | None:
    """Optimiser steps a seed replica of ``recipe_name`` shares with its entry (:data:`SHARED_WARMUP`): the steps of
    ``phases`` through the shared phase; None when the recipe shares none or the overrides dropped that phase (then
    a replica trains from step 0 on its own seed, like a replica of any other recipe)."""
    names = [p.name for p in phases]
    last = SHARED_WARMUP.get(recipe_name)
    return None if last not in names else sum(p.steps for p in phases[:names.index(last) + 1])


def zoo_recipe(name: str, kind: str, overrides: dict, *, seed: int, threads: int, tokenizer: str,
               warm_start: str | None = None) -> dict:
    """Everything that determines a zoo model's trained weights, as plain JSON.

    The architecture (class, text and vision config fields of the zoo entry),
    the resolved phases of its recipe (after ``overrides``), the seed, the torch
    thread count (intra-op reductions round differently with more threads) and
    the tokenizer's own recipe hash, and the code that trains it (``code``: :func:`kvbench.utils.recipe.code_version`
    of :data:`TRAINING_ENTRY`, the digest of every ``kvbench`` module the training runs and the library versions;
    a retrain under changed training code used to keep the hash and move Table 1 by up to 9 points, issue #33).
    Its :func:`kvbench.utils.recipe.recipe_hash` names the model's directory (``zoo/<profile>/<name>-<hash>/``);
    slices, floors and scheduler settings are not part of it. ``warm_start``: for a seed replica of a recipe in
    :data:`SHARED_WARMUP`, the recipe hash of the entry whose saved warm-up state it starts from (so a retrained
    entry renames its replicas); recorded as ``warm_start``, with the steps shared.

    Raises:
        KeyError: ``name`` is not a zoo entry or a seed replica of one.
        ValueError: ``kind`` is not the entry's family, or bad overrides (:func:`apply_overrides`).
    """
    from kvbench.models.tiny import zoo_spec   # here: it imports transformers; the recipes are read at DAG time

    spec = zoo_spec(name)
    if spec.kind != kind:
        raise ValueError(f"zoo model {name!r} is a {spec.kind!r} model, not {kind!r}")
    phases = apply_overrides(RECIPES[spec.recipe_name](), overrides)
    arch = {"architecture": spec.architecture, "text": spec.text, "vision": spec.vision, "recipe": spec.recipe_name}
    recipe = {"model": name, "kind": kind, "seed": seed, "threads": threads, "tokenizer": tokenizer,
              "code": code_version(TRAINING_ENTRY), "arch": json.loads(json.dumps(arch)),
              "phases": json.loads(json.dumps([phase_fields(p) for p in phases]))}
    if warm_start is not None:
        recipe["warm_start"] = {"entry": warm_start, "steps": warmup_steps(spec.recipe_name, phases)}
    return recipe


#: Phase fields added after zoo models were trained, with the value those models had: left out of the recipe
#: while they hold it, so that adding a field does not rename (and retrain) every trained model.
LATER_FIELDS = {"stale_pages": 0.0, "skip_supervision": 0.0, "head_layers": (0, 1), "identity_layers": ()}


def check_head_layers(phases: list[Phase], n_layers: int) -> None:
    """Raise ValueError naming the phase whose supervised heads (``head_layers``, when it supervises heads) or
    ``identity_layers`` lie outside a model of ``n_layers`` decoder layers: checked before training, not when that
    phase starts."""
    for p in phases:
        if p.head_supervision and not p.head_layers[1] < n_layers:
            raise ValueError(f"phase {p.name!r}: head_layers {tuple(p.head_layers)} names layer {p.head_layers[1]}, but "
                             f"the model has {n_layers} decoder layers (0..{n_layers - 1})")
        if p.identity_layers and not max(p.identity_layers) < n_layers:
            raise ValueError(f"phase {p.name!r}: identity_layers {tuple(p.identity_layers)} names layer "
                             f"{max(p.identity_layers)}, but the model has {n_layers} decoder layers (0..{n_layers - 1})")


def phase_fields(phase: Phase | dict) -> dict:
    """The phase's fields as they enter the recipe hash and a saved training state's recipe (:data:`LATER_FIELDS`
    at their old value left out, so a state saved before such a field existed still resumes)."""
    d = asdict(phase) if isinstance(phase, Phase) else phase
    old = lambda k, v: k in LATER_FIELDS and (tuple(v) if isinstance(v, list) else v) == LATER_FIELDS[k]  # noqa: E731
    return {k: v for k, v in d.items() if not old(k, v)}


def apply_overrides(phases: list[Phase], overrides: dict) -> list[Phase]:
    """Apply recipe overrides.

    Supported keys: ``steps_scale`` (float > 0: multiply every phase's steps,
    at least 1 step each; used by CI's reduced budget), ``phases`` (dict
    phase name -> dict of :class:`Phase` fields to replace), ``drop_phases``
    (list of phase names).

    Raises:
        ValueError: an unknown key, phase name or field, or a bad scale.
    """
    allowed = {"steps_scale", "phases", "drop_phases"}
    bad = set(overrides) - allowed
    if bad:
        raise ValueError(f"unknown training override(s) {sorted(bad)}; expected {sorted(allowed)}")
    names = {p.name for p in phases}
    for n in list(overrides.get("phases", {})) + list(overrides.get("drop_phases", [])):
        if n not in names:
            raise ValueError(f"override names unknown phase {n!r}; phases are {sorted(names)}")
    out = []
    for p in phases:
        if p.name in overrides.get("drop_phases", []):
            continue
        fields = overrides.get("phases", {}).get(p.name, {})
        unknown = set(fields) - set(Phase.__dataclass_fields__)
        if unknown:
            raise ValueError(f"phase {p.name!r}: unknown field(s) {sorted(unknown)}")
        p = replace(p, **fields)
        if not (isinstance(p.stale_pages, (int, float)) and 0 <= p.stale_pages <= 1):
            raise ValueError(f"phase {p.name!r}: stale_pages must be a share in [0, 1], got {p.stale_pages!r}")
        if not (isinstance(p.skip_supervision, (int, float)) and p.skip_supervision >= 0):
            raise ValueError(f"phase {p.name!r}: skip_supervision must be a weight >= 0, got {p.skip_supervision!r}")
        if not (isinstance(p.head_layers, (list, tuple)) and len(p.head_layers) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) for x in p.head_layers)
                and 0 <= p.head_layers[0] < p.head_layers[1]):
            raise ValueError(f"phase {p.name!r}: head_layers must be two layer indices (previous-token layer, "
                             f"induction layer), the first below the second, got {p.head_layers!r}")
        p = replace(p, head_layers=tuple(p.head_layers))
        if not (isinstance(p.identity_layers, (list, tuple))
                and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in p.identity_layers)
                and len(set(p.identity_layers)) == len(p.identity_layers)):
            raise ValueError(f"phase {p.name!r}: identity_layers must be distinct layer indices >= 0, "
                             f"got {p.identity_layers!r}")
        p = replace(p, identity_layers=tuple(sorted(p.identity_layers)))
        if p.head_supervision and set(p.head_layers) & set(p.identity_layers):
            raise ValueError(f"phase {p.name!r}: a supervised head's layer {sorted(set(p.head_layers) & set(p.identity_layers))} "
                             f"cannot be an identity layer (the phase's identity_layers {p.identity_layers}, the "
                             f"recipe's unless overridden: set identity_layers in the same override)")
        if p.skip_supervision and not p.head_supervision:
            raise ValueError(f"phase {p.name!r}: skip_supervision needs head_supervision (the skip head reads the "
                             "supervised previous-token head)")
        if p.stale_pages and not p.hide_prompt:
            raise ValueError(f"phase {p.name!r}: stale_pages needs hide_prompt ('prefix' or 'text')")
        if p.cell_target not in CELL_TARGETS:
            raise ValueError(f"phase {p.name!r}: cell_target must be one of {CELL_TARGETS}, got {p.cell_target!r}")
        scale = overrides.get("steps_scale", 1.0)
        if not isinstance(scale, (int, float)) or scale <= 0:
            raise ValueError(f"steps_scale must be a positive number, got {scale!r}")
        out.append(replace(p, steps=max(1, round(p.steps * scale))))
    return out
