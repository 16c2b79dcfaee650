"""Mixed precision (``torch.amp``): autocast's 16-bit products, dynamic loss scaling."""
from .autocast_mode import autocast, get_autocast_dtype, is_autocast_enabled  # noqa: F401
from .grad_scaler import GradScaler  # noqa: F401
