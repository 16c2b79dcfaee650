"""torch.utils.data.DataLoader: batches of a dataset's samples in a sampler's order, collated
into tensors, with torch's samplers, so a seeded shuffle gives torch's batches.

    loader = DataLoader(dataset, batch_size=32, shuffle=True,
                        generator=minipar.Generator().manual_seed(0))
    for x, y in loader:                 # the last batch is shorter unless drop_last=True
        ...

A sampler yields dataset indices; the loader groups ``batch_size`` of them, fetches each sample
(``dataset[i]``) and ``default_collate`` stacks them. ``num_workers`` and ``pin_memory`` are
accepted, and the batches are the same: minipar loads them in this process.
"""
import numbers

from ... import backend
from ...autograd import Tensor
from ...generator import permutation


class Sampler:
    """Base of the samplers: an iterable of dataset indices with a length."""

    def __init__(self, data_source=None):
        self.data_source = data_source

    def __len__(self):
        return len(self.data_source)


class SequentialSampler(Sampler):
    def __iter__(self):
        return iter(range(len(self.data_source)))


class RandomSampler(Sampler):
    """A fresh permutation each pass, torch's from ``generator`` (a seeded ``minipar.Generator``),
    else seeded from minipar's stream (``minipar.manual_seed``)."""

    def __init__(self, data_source, generator=None):
        super().__init__(data_source)
        self.generator = generator

    def __iter__(self):
        n = len(self.data_source)
        yield from permutation(n, self.generator).tolist()
        if self.generator is not None:
            # torch's then draws a second permutation, for a remainder of no samples: its
            # numbers are drawn too, so the next epoch's shuffle is torch's as well
            self.generator.draws(max(n - 1, 0))


def default_collate(batch):
    """A list of samples as one batch: tensors, arrays and numbers stacked along a new first
    axis; tuples and lists collated field by field (a list, as torch's), dicts key by key."""
    first = batch[0]
    if isinstance(first, (Tensor, numbers.Number)) or hasattr(first, "__array__"):
        xp = backend.xp()
        return Tensor(xp.stack([xp.asarray(s.data if isinstance(s, Tensor) else s)
                                for s in batch]))
    if isinstance(first, dict):
        return {key: default_collate([s[key] for s in batch]) for key in first}
    if isinstance(first, (tuple, list)):
        if len({len(s) for s in batch}) != 1:
            raise RuntimeError("default_collate: each element in list of batch should be of "
                               "equal size (torch's rule)")
        return [default_collate(list(field)) for field in zip(*batch)]
    raise TypeError(f"default_collate: batch must contain tensors, arrays, numbers, dicts or "
                    f"lists; found {type(first).__name__}")


class DataLoader:
    """Batches of ``dataset`` in ``sampler``'s order (sequential, or ``shuffle=True``: random),
    ``batch_size`` at a time; ``drop_last`` drops a last short batch."""

    def __init__(self, dataset, batch_size=1, shuffle=False, sampler=None, num_workers=0,
                 collate_fn=None, pin_memory=False, drop_last=False, generator=None):
        if not isinstance(batch_size, numbers.Integral) or batch_size <= 0:
            raise ValueError(f"DataLoader: batch_size should be a positive integer value, but "
                             f"got batch_size={batch_size}")
        if sampler is not None and shuffle:
            raise ValueError("DataLoader: sampler option is mutually exclusive with shuffle "
                             "(torch's rule): shuffle in the sampler instead")
        if num_workers < 0:
            raise ValueError(f"DataLoader: num_workers must be at least 0, got {num_workers}")
        self.dataset, self.batch_size, self.drop_last = dataset, batch_size, drop_last
        self.num_workers, self.pin_memory, self.generator = num_workers, pin_memory, generator
        self.collate_fn = collate_fn or default_collate
        self.sampler = sampler if sampler is not None else (
            RandomSampler(dataset, generator) if shuffle else SequentialSampler(dataset))

    def __len__(self):
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self):
        if self.generator is not None:
            # torch's iterator first draws a 64-bit seed for its workers from the generator
            # (two 32-bit draws): drawn here too, so the shuffles that follow are torch's
            self.generator.draws(2)
        batch = []
        for index in self.sampler:
            batch.append(self.dataset[index])
            if len(batch) == self.batch_size:
                yield self.collate_fn(batch)
                batch = []
        if batch and not self.drop_last:
            yield self.collate_fn(batch)
