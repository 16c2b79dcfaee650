"""Bundled real data, no download: English text for a character-level GPT, digit images for a
ResNet."""
from .images import load_digits  # noqa: F401
from .text import CharTokenizer, get_batch, load_text  # noqa: F401
