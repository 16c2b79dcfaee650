"""Mixed precision (``torch.amp``): autocast's 16-bit products, dynamic loss scaling; FP8
training (torchao's Float8Linear, the scaling recipes: float8.py, float8_recipes.py)."""
from .autocast_mode import autocast, get_autocast_dtype, is_autocast_enabled  # noqa: F401
from .grad_scaler import GradScaler  # noqa: F401
from .float8 import Float8Linear, convert_to_float8_training, scaled_mm  # noqa: F401
from .float8_recipes import (DelayedScaling, dequantize, quantize_blocks,  # noqa: F401
                             quantize_mx, quantize_tensorwise, quantize_tiles)
