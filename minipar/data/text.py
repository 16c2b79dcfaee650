"""Real English text for character-level language modelling, bundled: nothing is downloaded.

    "pydoc"     the Python standard library's own help text (``pydoc_data.topics``, the pages
                ``help("if")`` shows): about 460 KB of technical English prose and code, shipped
                with every CPython (its content follows the Python version, PSF licence)
    "sonnets"   six of Shakespeare's sonnets (public domain), 4 KB: small enough to memorise

    text = load_text("pydoc")
    tok = CharTokenizer(text)             # the vocabulary is the set of characters seen
    data = tok.encode(text)               # 1-D integer NumPy array
    x, y = get_batch(data, 16, 32)        # (16, 32) inputs and their next-character targets
"""
import pathlib

from .. import backend, random

_HERE = pathlib.Path(__file__).resolve().parent


def _host():
    return backend.get_array_module()  # the module of no arrays: NumPy, for host-side data


def load_text(name="pydoc"):
    """The corpus as one string."""
    if name == "pydoc":
        from pydoc_data.topics import topics

        return "\n\n".join(topics[key].strip() for key in sorted(topics)) + "\n"
    if name == "sonnets":
        return (_HERE / "sonnets.txt").read_text(encoding="utf-8")
    raise ValueError(f"unknown text {name!r}: choose 'pydoc' or 'sonnets'")


class CharTokenizer:
    """One token per distinct character, numbered in sorted order."""

    def __init__(self, text):
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        self.vocab_size = len(self.chars)

    def encode(self, text):
        try:
            return _host().array([self.stoi[c] for c in text], dtype="int64")
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the vocabulary") from None

    def decode(self, ids):
        return "".join(self.chars[int(i)] for i in backend.to_numpy(ids).reshape(-1))


def get_batch(data, batch_size, block_size, rng=None):
    """``batch_size`` random windows of ``data``: x = data[i:i+block], y = data[i+1:i+block+1].

    ``rng`` is a NumPy Generator; by default offsets come from ``minipar.random`` (seeded).
    Returns two (batch_size, block_size) int64 arrays on the current device.
    """
    if len(data) <= block_size:
        raise ValueError(f"get_batch: the data has {len(data)} tokens, needs more than "
                         f"block_size={block_size}")
    rng = rng if rng is not None else random.generator(_host())
    starts = rng.integers(0, len(data) - block_size, size=batch_size)
    index = starts[:, None] + _host().arange(block_size + 1)
    windows = backend.to_numpy(data)[index]
    return backend.asarray(windows[:, :-1]), backend.asarray(windows[:, 1:])
