"""minipar.utils.data against torch.utils.data: TensorDataset, DataLoader (batch_size, shuffle
with a seeded generator, drop_last, sampler=, collation of tensors, tuples and dicts) and
DistributedSampler over a dataset: the same batches, epoch after epoch."""
import numpy as np
import pytest

import minipar
from minipar.utils.data import (DataLoader, Dataset, DistributedSampler, TensorDataset,
                                default_collate)

torch = pytest.importorskip("torch")
tdata = torch.utils.data
X, Y = np.arange(26.0).reshape(13, 2), np.arange(13) % 3


def batches(loader, epochs=2):
    return [[b.numpy().tolist() for b in batch] for _ in range(epochs) for batch in loader]


@pytest.mark.parametrize("batch_size, drop_last", [(4, False), (4, True), (13, False), (1, True)])
def test_sequential_batches_equal_torchs(batch_size, drop_last):
    ours = DataLoader(TensorDataset(minipar.tensor(X), minipar.tensor(Y)), batch_size,
                      drop_last=drop_last)
    theirs = tdata.DataLoader(tdata.TensorDataset(torch.tensor(X), torch.tensor(Y)), batch_size,
                              drop_last=drop_last)
    assert len(ours) == len(theirs) and batches(ours) == batches(theirs)


@pytest.mark.parametrize("seed", [0, 5])
def test_a_seeded_shuffle_gives_torchs_batches_every_epoch(seed):
    ours = DataLoader(TensorDataset(minipar.tensor(X), minipar.tensor(Y)), 5, shuffle=True,
                      generator=minipar.Generator().manual_seed(seed))
    theirs = tdata.DataLoader(tdata.TensorDataset(torch.tensor(X), torch.tensor(Y)), 5,
                              shuffle=True, generator=torch.Generator().manual_seed(seed))
    assert batches(ours, 3) == batches(theirs, 3)


def test_an_unseeded_shuffle_follows_minipars_stream():
    loader = DataLoader(TensorDataset(minipar.tensor(X)), 13, shuffle=True)
    minipar.manual_seed(1)
    first = batches(loader, 2)
    minipar.manual_seed(1)
    assert batches(loader, 2) == first and first[0] != first[1]
    assert sorted(v for row in first[0][0] for v in row) == sorted(X.ravel().tolist())


@pytest.mark.parametrize("shuffle, drop_last", [(True, False), (False, True), (True, True)])
def test_distributed_sampler_over_a_dataset_equals_torchs(shuffle, drop_last):
    ranks, data = 3, TensorDataset(minipar.tensor(X), minipar.tensor(Y))
    for rank in range(ranks):
        ours = DistributedSampler(data, num_replicas=ranks, rank=rank, shuffle=shuffle, seed=4,
                                  drop_last=drop_last)
        theirs = tdata.DistributedSampler(range(13), num_replicas=ranks, rank=rank,
                                          shuffle=shuffle, seed=4, drop_last=drop_last)
        for epoch in (0, 1):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs) and len(ours) == len(theirs)
        loader = DataLoader(data, 2, sampler=ours)
        assert [b[1].tolist() for b in loader] == \
            [Y[list(ours)[i:i + 2]].tolist() for i in range(0, len(ours), 2)]


def test_collate_of_tuples_dicts_and_numbers():
    class Pairs(Dataset):
        def __getitem__(self, i):
            return {"x": np.full(2, i), "y": float(i)}, (i, minipar.tensor([i, -i]))

        def __len__(self):
            return 3

    [(fields, (ints, rows))] = list(DataLoader(Pairs(), batch_size=3))
    assert fields["x"].tolist() == [[0, 0], [1, 1], [2, 2]] and fields["y"].tolist() == [0, 1, 2]
    assert ints.tolist() == [0, 1, 2] and rows.tolist() == [[0, 0], [1, -1], [2, -2]]
    theirs = tdata.default_collate([(1, torch.tensor([1.0])), (2, torch.tensor([2.0]))])
    ours = default_collate([(1, minipar.tensor([1.0])), (2, minipar.tensor([2.0]))])
    assert type(ours) is type(theirs) is list
    assert [t.tolist() for t in ours] == [t.tolist() for t in theirs]


def test_bad_arguments_are_named():
    data = TensorDataset(minipar.tensor(X))
    with pytest.raises(ValueError, match="mutually exclusive with shuffle"):
        DataLoader(data, 2, shuffle=True, sampler=range(3))
    with pytest.raises(ValueError, match="batch_size should be a positive integer"):
        DataLoader(data, 0)
    with pytest.raises(ValueError, match=r"first dimensions \[13, 2\] must be equal"):
        TensorDataset(minipar.tensor(X), minipar.tensor(Y[:2]))
    with pytest.raises(TypeError, match="found str"):
        default_collate(["a", "b"])
    with pytest.raises(ValueError, match=r"Invalid rank 3, rank should be in the interval \[0, 2\]"):
        DistributedSampler(data, num_replicas=3, rank=3)
