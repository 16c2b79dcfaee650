"""Parallel strategies: data, tensor and pipeline parallelism, each in its own module."""
