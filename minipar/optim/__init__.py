"""Optimizers (SGD, Adam, AdamW) with param groups, gradient clipping, and learning-rate schedules
(``minipar.optim.lr_scheduler``), named and behaving as torch.optim's."""
from . import lr_scheduler  # noqa: F401
from .adam import Adam, AdamW, Flat  # noqa: F401
from .optimizer import (Optimizer, SGD, check_hyperparameters, clip_grad_norm,  # noqa: F401
                        clip_grad_norm_)
