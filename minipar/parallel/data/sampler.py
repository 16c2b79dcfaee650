"""Which samples each rank trains on: a seeded shard per rank, reshuffled every epoch; it is
``torch.utils.data.DistributedSampler`` (also at that path), torch's very shards for a seed.

    sampler = DistributedSampler(n, num_replicas=comm.size, rank=comm.rank, seed=0)  # or a dataset
    sampler.set_epoch(epoch)
    for idx in sampler.batches(global_batch):   # this rank's local batches of global/N samples
        ...                                     # (or DataLoader(dataset, b, sampler=sampler))

Sizes that do not work are refused on every rank from its own arguments, so every rank raises
the same ValueError and no rank is left waiting in a collective.
"""
import math
import numbers

from ... import backend
from ...comm import world
from ...generator import Generator, permutation


def local_batch_size(global_batch, num_replicas):
    """The per-rank batch, ``global_batch / num_replicas``; ValueError unless it divides."""
    # averaging local-mean gradients equals the global-mean gradient only for equal local batches
    if global_batch <= 0 or global_batch % num_replicas:
        lower = max(num_replicas, global_batch // num_replicas * num_replicas)
        raise ValueError(
            f"global batch size {global_batch} does not divide among {num_replicas} ranks: use a "
            f"multiple of {num_replicas} (e.g. {lower} or {lower + num_replicas}), so that every "
            f"rank's loss is a mean over the same number of samples and the averaged gradient is "
            f"the gradient of the global-batch mean")
    return global_batch // num_replicas


class DistributedSampler:
    """Rank ``rank``'s share of a dataset (or of ``n`` samples); ``set_epoch(e)`` before each
    epoch reshuffles. ``num_replicas`` and ``rank`` default to the world's, as torch's to the
    default group's."""

    def __init__(self, dataset, num_replicas=None, rank=None, shuffle=True, seed=0,
                 drop_last=False):
        n = dataset if isinstance(dataset, numbers.Integral) else len(dataset)
        if num_replicas is None or rank is None:
            comm = world()
            num_replicas = comm.size if num_replicas is None else num_replicas
            rank = comm.rank if rank is None else rank
        if not 0 <= rank < num_replicas:
            raise ValueError(f"Invalid rank {rank}, rank should be in the interval "
                             f"[0, {num_replicas - 1}] for {num_replicas} replicas")
        if n < num_replicas:  # some rank would train only on copies of other ranks' samples
            raise ValueError(
                f"rank {rank}: the dataset has {n} samples, fewer than the {num_replicas} ranks: "
                f"some rank would get no sample of its own; use at most {n} ranks or more data")
        self.n, self.num_replicas, self.rank = n, num_replicas, rank
        self.shuffle, self.seed, self.drop_last, self.epoch = shuffle, seed, drop_last, 0
        self.num_samples = n // num_replicas if drop_last else math.ceil(n / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def set_epoch(self, epoch):
        self.epoch = int(epoch)

    def permutation(self):
        """This epoch's order of all n indices, the same on every rank (seeded with
        ``seed + epoch``: no communication), before padding: torch.randperm's for that seed."""
        if self.shuffle:
            return permutation(self.n, Generator().manual_seed(self.seed + self.epoch))
        return backend.get_array_module().arange(self.n)  # NumPy: indices live on the host

    def indices(self):
        """This rank's indices for the current epoch (``num_samples`` of them): the permutation
        padded by wrapping around to a multiple of ``num_replicas`` (or, with ``drop_last``, cut
        down to one), then every ``num_replicas``-th index starting at ``rank``. So the shards
        are disjoint (apart from the padding) and together cover the data."""
        order = self.permutation()
        if self.total_size > self.n:  # pad by wrapping around (fewer than num_replicas extra)
            extra = order[:self.total_size - self.n]
            order = backend.get_array_module().concatenate([order, extra])
        return order[:self.total_size][self.rank::self.num_replicas]

    def __iter__(self):
        return iter(self.indices().tolist())

    def __len__(self):
        return self.num_samples

    def batches(self, global_batch):
        """This rank's local batches (index arrays of ``global_batch / num_replicas``) for the
        epoch; the last incomplete one is dropped, so every rank takes the same number of
        steps."""
        # Rank r's k-th local batch of b samples is positions [k·b, (k+1)·b) of its shard, i.e.
        # permutation entries r + N·j for j in that range; over all ranks these are exactly the
        # consecutive entries [k·N·b, (k+1)·N·b) of the permutation: N ranks with local batch b
        # see the very global batch of N·b samples that serial training reading the permutation
        # in order sees.
        b = local_batch_size(global_batch, self.num_replicas)
        mine = self.indices()
        return [mine[k * b:(k + 1) * b] for k in range(len(mine) // b)]
