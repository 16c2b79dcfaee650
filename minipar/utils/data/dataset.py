"""torch.utils.data's datasets: ``Dataset`` (a class to subclass: ``__getitem__``, ``__len__``)
and ``TensorDataset``, the rows of tensors of one length.

    dataset = TensorDataset(x, y)       # dataset[i] == (x[i], y[i]), len(dataset) == len(x)
"""


class Dataset:
    """A map-style dataset: subclass it, define ``__getitem__(i)`` and ``__len__()``."""

    def __getitem__(self, index):
        raise NotImplementedError(f"{type(self).__name__} must define __getitem__(index)")


class TensorDataset(Dataset):
    """Sample i is ``(t[i] for t in tensors)``; all tensors need the same first dimension."""

    def __init__(self, *tensors):
        if not tensors:
            raise ValueError("TensorDataset needs at least one tensor")
        sizes = [len(t) for t in tensors]
        if len(set(sizes)) != 1:
            raise ValueError(f"TensorDataset: size mismatch between tensors: first dimensions "
                             f"{sizes} must be equal")
        self.tensors = tensors

    def __getitem__(self, index):
        return tuple(t[index] for t in self.tensors)

    def __len__(self):
        return len(self.tensors[0])
