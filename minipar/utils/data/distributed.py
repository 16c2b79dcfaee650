"""torch.utils.data.distributed's path (facade: ``minipar.FACADE``): DistributedSampler lives in
``minipar.parallel.data.sampler``, on lesson 05's reading path.

    from minipar.utils.data.distributed import DistributedSampler
"""
from ...parallel.data.sampler import DistributedSampler  # noqa: F401
