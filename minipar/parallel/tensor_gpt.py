"""Old path: the tensor-parallel GPT and its traffic report are in minipar/parallel/tensor/."""
from .tensor import *  # noqa: F401,F403
