"""torch.utils.data's path (facade: ``minipar.FACADE``): Dataset and TensorDataset live in
``dataset.py``, DataLoader and its samplers in ``dataloader.py``, DistributedSampler in
``minipar.parallel.data.sampler`` (lesson 05's reading path).

    from minipar.utils.data import DataLoader, TensorDataset
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
"""
from . import distributed  # noqa: F401
from ...parallel.data.sampler import DistributedSampler  # noqa: F401
from .dataloader import (DataLoader, RandomSampler, Sampler, SequentialSampler,  # noqa: F401
                         default_collate)
from .dataset import Dataset, TensorDataset  # noqa: F401
