"""Mixed precision (``torch.amp``): autocast's 16-bit matrix products, float32 where it matters."""
from .autocast_mode import autocast, get_autocast_dtype, is_autocast_enabled  # noqa: F401
