"""Cluster recovery metrics: the highest-weight particle and the adjusted Rand index
(hand-computed cases, batching, agreement with scikit-learn, bad labels).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from apg.metrics import adjusted_rand_index, highest_weight_particle

# --------------------------------------------------------------------------- ARI


def test_highest_weight_particle_takes_each_datasets_own_best():
    # (L=3, B=2): dataset 0's best is particle 2, dataset 1's is particle 0.
    log_w = torch.tensor([[-1.0, 5.0], [0.0, -2.0], [3.0, 1.0]])
    z = {"mu": torch.arange(3 * 2 * 4.0).reshape(3, 2, 4), "c": torch.tensor([[7, 8], [9, 10], [11, 12]])}
    chosen = highest_weight_particle(z, log_w)
    assert torch.equal(chosen["mu"], torch.stack([z["mu"][2, 0], z["mu"][0, 1]]))
    assert torch.equal(chosen["c"], torch.tensor([11, 8]))


def test_ari_is_one_for_the_same_partition_under_any_relabeling():
    true = torch.tensor([0, 0, 1, 1, 2, 2, 2])
    for perm in ([1, 2, 0], [2, 0, 1], [0, 2, 1]):
        pred = torch.tensor(perm)[true] + 5  # relabelled, and labels need not start at 0
        assert adjusted_rand_index(true, pred).item() == pytest.approx(1.0)


def test_ari_hand_computed_examples():
    # [0,0,0,1,1,1] vs [0,0,1,1,2,2]: pairs together in both 2, row pairs 3+3=6, column pairs
    # 1+1+1=3, all pairs C(6,2)=15: expected 6*3/15=1.2, max (6+3)/2=4.5 -> (2-1.2)/(4.5-1.2).
    a = torch.tensor([0, 0, 0, 1, 1, 1])
    b = torch.tensor([0, 0, 1, 1, 2, 2])
    assert adjusted_rand_index(a, b).item() == pytest.approx(0.8 / 3.3)
    assert adjusted_rand_index(b, a).item() == pytest.approx(0.8 / 3.3)  # symmetric
    # [0,0,1,1] vs [0,1,0,1]: no pair together in both; expected 2*2/6 -> (0-2/3)/(2-2/3) = -1/2.
    assert adjusted_rand_index(
        torch.tensor([0, 0, 1, 1]), torch.tensor([0, 1, 0, 1])
    ).item() == pytest.approx(-0.5)
    # One cluster against all singletons: the index is 0 = its expectation.
    assert adjusted_rand_index(torch.zeros(4, dtype=torch.long), torch.arange(4)).item() == pytest.approx(0.0)
    # Both trivial and equal: defined as 1 (the 0/0 case).
    assert (
        adjusted_rand_index(torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long)).item() == 1.0
    )


def test_ari_is_batched_per_dataset():
    true = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 0, 0], [0, 1, 2, 0, 1, 2]])
    pred = torch.tensor([[0, 0, 1, 1, 2, 2], [1, 1, 0, 0, 1, 1], [0, 1, 2, 0, 1, 2]])
    got = adjusted_rand_index(true, pred)
    assert got.shape == (3,)
    singles = torch.stack([adjusted_rand_index(t, p) for t, p in zip(true, pred, strict=True)])
    torch.testing.assert_close(got, singles)
    assert got[1].item() == pytest.approx(1.0) and got[2].item() == pytest.approx(1.0)


def test_ari_matches_scikit_learn_on_random_partitions():
    metrics = pytest.importorskip("sklearn.metrics")
    gen = torch.Generator().manual_seed(0)
    true = torch.randint(3, (20, 40), generator=gen)
    pred = torch.where(
        torch.rand(20, 40, generator=gen) < 0.7, true, torch.randint(4, (20, 40), generator=gen)
    )
    want = [metrics.adjusted_rand_score(t.numpy(), p.numpy()) for t, p in zip(true, pred, strict=True)]
    np.testing.assert_allclose(adjusted_rand_index(true, pred).numpy(), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "true, pred, message",
    [
        (torch.zeros(3, dtype=torch.long), torch.zeros(4, dtype=torch.long), "shaped alike"),
        (torch.zeros(3), torch.zeros(3), "integers"),
        (torch.tensor([0, -1]), torch.tensor([0, 1]), "non-negative"),
    ],
)
def test_ari_rejects_bad_labels(true, pred, message):
    with pytest.raises(ValueError, match=message):
        adjusted_rand_index(true, pred)
