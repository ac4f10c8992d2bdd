"""`full_catalog_topk` against torch's sort/topk on the materialized `[N, V]` scores."""

import pytest
import torch

from parity import assert_close
from torch_cutbce.topk import full_catalog_topk


def reference_topk(hidden, item_weight, k, bias=None, exclude=None):
    """Materialized scores; ties to the lower id via a stable descending sort."""
    scores = hidden.reshape(-1, hidden.shape[-1]).to(torch.float64) @ item_weight.to(torch.float64).T
    if bias is not None:
        scores = scores + bias.to(torch.float64)
    if exclude is not None:
        for row, ids in enumerate(exclude.reshape(scores.shape[0], -1)):
            ids = ids[(ids >= 0) & (ids < scores.shape[1])]
            scores[row, ids] = float("-inf")
    ranked = torch.sort(scores, dim=1, descending=True, stable=True)
    lead = hidden.shape[:-1]
    return ranked.values[:, :k].reshape(*lead, k), ranked.indices[:, :k].reshape(*lead, k)


@pytest.mark.parametrize("num_items, block_v, k", [(1001, 97, 10), (257, None, 5), (13, 3, 13), (40, 64, 7), (50, 1, 4)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_materialized_scores(num_items, block_v, k, with_bias):
    g = torch.Generator().manual_seed(num_items + k)
    hidden = torch.randn(3, 11, 16, generator=g)  # leading shape S = (3, 11): odd N = 33
    item_weight = torch.randn(num_items, 16, generator=g)
    bias = torch.randn(num_items, generator=g) if with_bias else None
    scores, ids = full_catalog_topk(hidden, item_weight, k, bias, block_v=block_v)
    ref_scores, ref_ids = reference_topk(hidden, item_weight, k, bias)
    assert ids.shape == (3, 11, k) and scores.dtype == torch.float32
    torch.testing.assert_close(ids, ref_ids, rtol=0, atol=0)  # ids exactly: no ties in random scores
    assert_close(scores, ref_scores, dtype="float32", name="top-k scores")
    # torch.topk picks the same items (no ties with continuous random scores)
    top = (hidden @ item_weight.T + (bias if with_bias else 0)).topk(k, dim=-1)
    torch.testing.assert_close(ids, top.indices, rtol=0, atol=0)


@pytest.mark.parametrize("block_v", [4, 7, 1000])
def test_ties_rank_lower_ids_first(block_v):
    """Integer-valued scores with many ties, including ties across tile boundaries and at the k-th place."""
    g = torch.Generator().manual_seed(block_v)
    hidden = torch.randint(-2, 3, (29, 4), generator=g).float()
    item_weight = torch.randint(-1, 2, (61, 4), generator=g).float()
    for k in (1, 6, 61):
        scores, ids = full_catalog_topk(hidden, item_weight, k, block_v=block_v)
        ref_scores, ref_ids = reference_topk(hidden, item_weight, k)
        torch.testing.assert_close(ids, ref_ids, rtol=0, atol=0)
        torch.testing.assert_close(scores.double(), ref_scores, rtol=0, atol=0)


def test_all_scores_equal_gives_the_first_k_ids():
    ids = full_catalog_topk(torch.ones(5, 1), torch.ones(100, 1), 10, block_v=7)[1]
    assert torch.equal(ids, torch.arange(10).expand(5, 10))


def test_exclusions():
    g = torch.Generator().manual_seed(0)
    hidden, item_weight = torch.randn(9, 8, generator=g), torch.randn(23, 8, generator=g)
    exclude = torch.randint(-1, 30, (9, 12), generator=g)  # padding -1 and ids >= V are ignored
    exclude[0] = torch.arange(12)  # row 0: excluded ids fill several tiles
    for k, block_v in [(5, 4), (11, 23), (23, 6)]:  # k = V: excluded items come last, at -inf
        scores, ids = full_catalog_topk(hidden, item_weight, k, block_v=block_v, exclude=exclude)
        ref_scores, ref_ids = reference_topk(hidden, item_weight, k, exclude=exclude)
        torch.testing.assert_close(ids, ref_ids, rtol=0, atol=0)
        assert_close(scores, ref_scores, dtype="float32", name=f"top-{k} scores with exclusions")
    assert torch.isinf(scores[0, -12:]).all() and set(ids[0, -12:].tolist()) == set(range(12))


def test_float64_inputs_stay_float64():
    hidden, item_weight = torch.randn(4, 3, dtype=torch.float64), torch.randn(9, 3, dtype=torch.float64)
    scores, ids = full_catalog_topk(hidden, item_weight, 3, block_v=2)
    assert scores.dtype == torch.float64
    assert_close(scores, reference_topk(hidden, item_weight, 3)[0], dtype="float64", name="float64 top-k scores")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(k=0), "k must be in"),
        (dict(k=10), "k must be in"),
        (dict(k=2, block_v=0), "block_v must be >= 1"),
        (dict(k=2, bias=torch.zeros(3)), "bias must have shape"),
        (dict(k=2, exclude=torch.zeros(4, 2)), "exclude must be integer ids"),
        (dict(k=2, exclude=torch.zeros(3, 2, dtype=torch.long)), "exclude must be integer ids"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        full_catalog_topk(torch.randn(4, 3), torch.randn(9, 3), **kwargs)
    with pytest.raises(ValueError, match="same D"):
        full_catalog_topk(torch.randn(4, 3), torch.randn(9, 2), 2)


@pytest.mark.xla
def test_on_an_xla_device(monkeypatch):
    """On XLA the exact tie pass always runs (no host sync to decide); same result as on CPU."""
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    torch_xla = pytest.importorskip("torch_xla")
    device = torch_xla.device()
    g = torch.Generator().manual_seed(1)
    hidden = torch.randint(-2, 3, (12, 4), generator=g).float()
    item_weight = torch.randint(-1, 2, (37, 4), generator=g).float()
    exclude = torch.randint(-1, 37, (12, 5), generator=g)
    expected = reference_topk(hidden, item_weight, 6, exclude=exclude)
    scores, ids = full_catalog_topk(hidden.to(device), item_weight.to(device), 6, block_v=8, exclude=exclude.to(device))
    torch.testing.assert_close(ids.cpu(), expected[1], rtol=0, atol=0)
    torch.testing.assert_close(scores.cpu().double(), expected[0], rtol=0, atol=0)
