"""Reference schedules and nearest-reference retrieval (kvbench.compress.residualkv.references)."""

import itertools
import math

import pytest
import torch

from kvbench.compress.residualkv.references import (
    GRIDS,
    approx_reference_count,
    nearest_references,
    reference_count,
    reference_mask,
    reference_positions,
    references_between,
)
from kvbench.kernels.reference_mean import mean_reference


def _refs(T, **kw):
    return torch.nonzero(reference_mask(torch.arange(T), **kw)).flatten().tolist()


def test_paper_grid_fixed_stride():
    assert _refs(40, n_sink=4, stride=10) == [4, 14, 24, 34]
    assert _refs(4, n_sink=4, stride=10) == []  # sinks are not references in the paper grid
    assert _refs(12, n_sink=0, stride=3) == [0, 3, 6, 9]


def test_paper_grid_dynamic_stride_recurrence():
    # p0 = 2; p1 = 2 + 5 + floor(0.5*0) = 7; p2 = 7 + 5 + floor(0.5*5) = 14; p3 = 14 + 5 + 6 = 25;
    # p4 = 25 + 5 + floor(11.5) = 41
    assert _refs(42, n_sink=2, stride=5, alpha=0.5) == [2, 7, 14, 25, 41]


def test_code_grid_restarts_per_block_and_keeps_sinks():
    refs = _refs(4 + 256 + 5, n_sink=4, stride=10, grid="code")
    block1 = [4 + 10 * m for m in range(13)]  # 0..120 within the block: 13 refs per 128 tokens
    block2 = [4 + 128 + 10 * m for m in range(13)]
    assert refs == [0, 1, 2, 3] + block1 + block2 + [4 + 256]
    assert reference_count(4 + 128 * 7, n_sink=4, stride=10, grid="code") == 4 + 13 * 7


def test_code_grid_dynamic_uses_absolute_positions():
    paper = _refs(500, n_sink=3, stride=10, alpha=0.05)
    code = _refs(500, n_sink=3, stride=10, alpha=0.05, grid="code")
    assert code == [0, 1, 2] + paper


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("alpha", [0.0, 0.01, 0.3])
def test_mask_independent_of_chunking(grid, alpha):
    kw = {"n_sink": 5, "stride": 7, "alpha": alpha, "grid": grid, "block": 32}
    whole = reference_mask(torch.arange(1000), **kw)
    cuts = [0, 1, 3, 100, 101, 357, 640, 999, 1000]
    chunked = torch.cat([reference_mask(torch.arange(a, b), **kw) for a, b in itertools.pairwise(cuts)])
    assert torch.equal(whole, chunked)
    # Any order and shape: the answer is per position.
    perm = torch.randperm(1000, generator=torch.Generator().manual_seed(0))
    assert torch.equal(reference_mask(perm.view(10, 100), **kw), whole[perm].view(10, 100))
    assert int(whole.sum()) == reference_count(1000, **kw)
    assert torch.equal(torch.nonzero(whole).flatten(), reference_positions(1000, **kw))


@pytest.mark.parametrize("grid", GRIDS)
def test_count_matches_mask(grid):
    for T in [0, 1, 4, 5, 6, 131, 132, 133, 517]:
        for alpha in [0.0, 0.02]:
            kw = {"n_sink": 5, "stride": 10, "alpha": alpha, "grid": grid}
            assert reference_count(T, **kw) == int(reference_mask(torch.arange(T), **kw).sum()), (T, alpha)


def test_table_vi_counts_reproduced_by_paper_grid():
    # Paper Table VI (Qwen2.5-7B, "262K"): 26,189 / 3,354 / 319 / 149 / 83 references for
    # α = 0 / 0.001 / 0.02 / 0.05 / 0.1. The exact context length is not stated; T = 261,898 with
    # 8 sinks (the authors' inference default) reproduces all five with the paper grid. The code grid
    # (13 refs per 128) would give 26,607 at α = 0, i.e. 10.16% instead of the reported 9.99%.
    counts = [reference_count(261_898, n_sink=8, stride=10, alpha=a) for a in (0, 0.001, 0.02, 0.05, 0.1)]
    assert counts == [26189, 3354, 319, 149, 83]
    assert reference_count(261_898, n_sink=8, stride=10, grid="code") == 26607


def test_approx_count_closed_form():
    assert approx_reference_count(1008, n_sink=8, s0=10, alpha=0.0) == 100.0
    assert approx_reference_count(5, n_sink=8, s0=10, alpha=0.1) == 0.0
    a, T = 0.02, 262_144
    expect = math.log(1 + a * (T - 8) / 10) / math.log(1 + a)
    assert approx_reference_count(T, n_sink=8, s0=10, alpha=a) == pytest.approx(expect, rel=1e-12)
    # floor only shortens steps, so the exact count is at least ceil(approx), and close to it.
    for a in (0.001, 0.01, 0.1):
        approx = approx_reference_count(T, n_sink=8, s0=10, alpha=a)
        exact = reference_count(T, n_sink=8, stride=10, alpha=a)
        assert math.ceil(approx) <= exact <= 1.02 * approx + 1
    assert reference_count(1008, n_sink=8, stride=10) == math.ceil(approx_reference_count(1008, n_sink=8, s0=10,
                                                                                          alpha=0.0))


def test_fast_for_a_million_tokens():
    m = reference_mask(torch.arange(1_000_000), n_sink=8, stride=10, alpha=0.001)
    assert int(m.sum()) == reference_count(1_000_000, n_sink=8, stride=10, alpha=0.001)
    # 999,992 = 7,812 blocks of 128 + 56; the last partial block holds offsets 0, 10, ..., 50.
    assert reference_count(1_000_000, n_sink=8, stride=10, grid="code") == 8 + 13 * 7812 + 6


@pytest.mark.parametrize("kw", [{"stride": 0}, {"alpha": -0.1}, {"n_sink": -1}, {"grid": "nope"},
                                {"alpha": float("nan")}])
def test_schedule_errors(kw):
    args = {"n_sink": 4, "stride": 10} | kw
    with pytest.raises(ValueError):
        reference_mask(torch.arange(10), **args)
    with pytest.raises(ValueError):
        reference_count(10, **args)


def test_position_errors():
    with pytest.raises(ValueError, match="integer"):
        reference_mask(torch.arange(10.0), n_sink=0, stride=2)
    with pytest.raises(ValueError, match=">= 0"):
        reference_mask(torch.tensor([3, -1]), n_sink=0, stride=2)


def _brute(kv, kv_pos, ref_kv, ref_pos, k, inclusive=False):
    out = []
    for x, p in zip(kv.double(), kv_pos.tolist()):
        vis = [j for j in range(len(ref_pos)) if (ref_pos[j] <= p if inclusive else ref_pos[j] < p)]
        d = [(float(((x - ref_kv[j].double()) ** 2).sum()), j) for j in vis]
        out.append([j for _, j in sorted(d)[:k]])
    return out


@pytest.mark.parametrize("inclusive", [False, True])
def test_nearest_matches_brute_force_with_causality(inclusive):
    g = torch.Generator().manual_seed(1)
    ref_pos = torch.tensor([0, 5, 10, 15, 20, 25])
    ref_kv = torch.randn(6, 8, generator=g)
    kv_pos = torch.arange(1, 30)
    kv = torch.randn(29, 8, generator=g)
    idx, valid = nearest_references(kv, kv_pos, ref_kv, ref_pos, 4, inclusive=inclusive)
    want = _brute(kv, kv_pos, ref_kv, ref_pos, 4, inclusive)
    for i, w in enumerate(want):
        n = len(w)
        assert valid[i].tolist() == [True] * n + [False] * (4 - n)
        assert idx[i, :n].tolist() == w
        assert idx[i, n:].tolist() == [0] * (4 - n)
        assert all(ref_pos[j] < kv_pos[i] or (inclusive and ref_pos[j] == kv_pos[i]) for j in idx[i, :n])
    # Token at position 5 sees only ref 0 (strict) or refs 0 and 1 (inclusive).
    assert valid[4].sum() == (2 if inclusive else 1)


def test_nearest_tie_break_lower_index_and_self_match():
    ref_kv = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [1.0, 0.0]])
    ref_pos = torch.tensor([0, 1, 2, 3])
    kv = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    idx, valid = nearest_references(kv, torch.tensor([10, 10]), ref_kv, ref_pos, 3)
    assert idx.tolist() == [[0, 2, 3], [1, 0, 2]]
    assert valid.all()
    # A reference token itself: strict causality excludes it, the code form includes it (distance 0).
    idx, _ = nearest_references(ref_kv[1:2], torch.tensor([1]), ref_kv, ref_pos, 1, inclusive=True)
    assert idx.tolist() == [[1]]
    idx, _ = nearest_references(ref_kv[1:2], torch.tensor([1]), ref_kv, ref_pos, 1)
    assert idx.tolist() == [[0]]


def test_nearest_chunked_equals_unchunked(monkeypatch):
    import kvbench.compress.residualkv.references as refmod

    g = torch.Generator().manual_seed(2)
    ref_kv, kv = torch.randn(50, 16, generator=g), torch.randn(300, 16, generator=g).to(torch.bfloat16)
    ref_pos = torch.arange(0, 500, 10)
    kv_pos = torch.arange(1, 301)
    whole = nearest_references(kv, kv_pos, ref_kv, ref_pos, 4)
    monkeypatch.setattr(refmod, "_CHUNK_ENTRIES", 7 * 50)  # 7 tokens per chunk
    chunked = nearest_references(kv, kv_pos, ref_kv, ref_pos, 4)
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])


def test_nearest_errors():
    ref_kv, ref_pos = torch.zeros(2, 4), torch.tensor([3, 7])
    with pytest.raises(ValueError, match="position 3"):
        nearest_references(torch.zeros(3, 4), torch.tensor([4, 3, 2]), ref_kv, ref_pos, 2)
    with pytest.raises(ValueError, match="k must be"):
        nearest_references(torch.zeros(1, 4), torch.tensor([9]), ref_kv, ref_pos, 0)
    with pytest.raises(ValueError, match="expected kv"):
        nearest_references(torch.zeros(1, 5), torch.tensor([9]), ref_kv, ref_pos, 1)
    with pytest.raises(ValueError, match="finite"):
        nearest_references(torch.full((1, 4), float("nan")), torch.tensor([9]), ref_kv, ref_pos, 1)


def test_mean_reference():
    ref_kv = torch.tensor([[0.0, 0.0], [2.0, 4.0], [4.0, 8.0]], dtype=torch.float16)
    idx = torch.tensor([[1, 2], [2, 0]])
    valid = torch.tensor([[True, True], [True, False]])
    out = mean_reference(ref_kv, idx, valid)
    assert out.dtype == torch.float32
    assert out.tolist() == [[3.0, 6.0], [4.0, 8.0]]
    # Differentiable in ref_kv (the codec's training backpropagates through the mean).
    leaf = ref_kv.float().requires_grad_()
    mean_reference(leaf, idx, valid).sum().backward()
    assert leaf.grad.tolist() == [[0.0, 0.0], [0.5, 0.5], [1.5, 1.5]]
    with pytest.raises(ValueError, match="no valid"):
        mean_reference(ref_kv, idx, torch.tensor([[True, True], [False, False]]))
    with pytest.raises(ValueError, match="out of range"):
        mean_reference(ref_kv, torch.tensor([[3, 0]]), torch.tensor([[True, False]]))


@pytest.mark.parametrize("kw", [{"n_sink": 4, "stride": 10}, {"n_sink": 0, "stride": 3},
                                {"n_sink": 4, "stride": 10, "alpha": 0.05},
                                {"n_sink": 4, "stride": 10, "grid": "code", "block": 16},
                                {"n_sink": 4, "stride": 10, "alpha": 0.05, "grid": "code"}])
def test_references_between_is_the_mask_on_a_range(kw):
    """The host-side schedule of a block of positions (the cache's coding path) is reference_mask's."""
    pos = torch.arange(300)
    want = pos[reference_mask(pos, **kw)].tolist()
    for start, end in ((0, 300), (3, 50), (37, 38), (120, 299), (250, 250)):
        assert references_between(start, end, **kw) == [p for p in want if start <= p < end], (start, end)
