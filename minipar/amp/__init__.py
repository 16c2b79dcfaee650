from minipar.amp.grad_scaler import GradScaler  # noqa: F401
