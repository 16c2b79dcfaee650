from .data.zero import ZeRO  # noqa: F401  (old path)
