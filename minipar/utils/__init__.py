"""torch.utils's path (facade: ``minipar.FACADE``): ``minipar.utils.data``."""
from . import data  # noqa: F401
