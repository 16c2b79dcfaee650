"""DistributedSampler: disjoint shards that cover the data, torch's padding and drop_last rules,
per-epoch reshuffles, and local batches that together are the serial global batch."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minipar.parallel.data import DistributedSampler, local_batch_size


def shards(n, ranks, **kw):
    return [DistributedSampler(n, ranks, r, **kw).indices() for r in range(ranks)]


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 60), ranks=st.integers(1, 8), drop_last=st.booleans(),
       seed=st.integers(0, 5), epoch=st.integers(0, 3))
def test_shards_cover_the_data(n, ranks, drop_last, seed, epoch):
    if n < ranks:
        with pytest.raises(ValueError, match="fewer than"):
            DistributedSampler(n, ranks, 0)
        return
    samplers = [DistributedSampler(n, ranks, r, seed=seed, drop_last=drop_last)
                for r in range(ranks)]
    for s in samplers:
        s.set_epoch(epoch)
    parts = [s.indices() for s in samplers]
    assert len({len(p) for p in parts}) == 1 and len(parts[0]) == len(samplers[0])
    flat = np.concatenate(parts)
    if drop_last:  # every index at most once, n mod ranks of them dropped
        assert len(flat) == n // ranks * ranks and len(set(flat.tolist())) == len(flat)
    else:  # every index at least once, fewer than `ranks` repeated by the wrap-around
        assert set(flat.tolist()) == set(range(n)) and len(flat) - n < ranks


def test_reshuffled_per_epoch_and_the_same_on_every_rank():
    a, b = DistributedSampler(40, 2, 0, seed=3), DistributedSampler(40, 2, 1, seed=3)
    first = a.permutation()
    assert (first == b.permutation()).all()
    a.set_epoch(1)
    assert not (a.permutation() == first).all()
    a.set_epoch(0)
    assert (a.permutation() == first).all()
    assert (DistributedSampler(9, 3, 1, shuffle=False).indices() == [1, 4, 7]).all()


def test_local_batches_are_the_serial_global_batch():
    ranks, B = 3, 12
    order = DistributedSampler(50, ranks, 0, seed=7).permutation()
    per_rank = [DistributedSampler(50, ranks, r, seed=7).batches(B) for r in range(ranks)]
    assert len(per_rank[0]) == 51 // B  # 17 per rank padded from 50 -> 51; last partial dropped
    for k in range(len(per_rank[0])):
        together = np.concatenate([p[k] for p in per_rank])
        assert sorted(together.tolist()) == sorted(order[k * B:(k + 1) * B].tolist())


def test_batch_that_does_not_divide_is_refused():
    assert local_batch_size(12, 4) == 3
    with pytest.raises(ValueError, match="does not divide among 4 ranks.*multiple of 4"):
        local_batch_size(10, 4)
    with pytest.raises(ValueError, match="does not divide"):
        DistributedSampler(100, 3, 0).batches(16)


@pytest.mark.parametrize("n,ranks,drop_last", [(10, 3, False), (10, 3, True), (9, 3, False),
                                               (11, 4, False), (5, 5, True)])
def test_matches_torch_without_shuffle(n, ranks, drop_last):
    torch_data = pytest.importorskip("torch.utils.data")
    for r in range(ranks):
        theirs = list(torch_data.DistributedSampler(range(n), ranks, r, shuffle=False,
                                                    drop_last=drop_last))
        assert DistributedSampler(n, ranks, r, shuffle=False, drop_last=drop_last).indices() \
            .tolist() == theirs
