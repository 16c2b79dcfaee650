"""torch.nn.parallel's path (facade: ``minipar.FACADE``): DistributedDataParallel lives in
``minipar.parallel.data.ddp``, on lesson 05's reading path.

    from minipar.nn.parallel import DistributedDataParallel as DDP
    model = DDP(net)          # over the default group, after dist.init_process_group()
"""
from ..parallel.data.ddp import DistributedDataParallel  # noqa: F401
