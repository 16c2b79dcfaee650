from .data.zero import ZeRO  # noqa: F401  (old path)
from .data.zero3 import ZeRO3  # noqa: F401
