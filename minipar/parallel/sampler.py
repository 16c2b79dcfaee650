from .data.sampler import DistributedSampler, local_batch_size  # noqa: F401  (old path)
