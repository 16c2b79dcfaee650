"""What goes wrong in communication, and the tags that let a receiver notice.

Collectives send every message with a tag that names its dtype (``dtype_tag``), on the
communicator's private channel; a receive checks the tag and the byte count, so ranks that
disagree on dtype or length get a ``CommError`` instead of a wrong sum.
"""
from minipar import backend


class CommError(ValueError):
    """Bad input to a communication call (sizes, dtypes, peers, ops or algorithms)."""


# NumPy type characters (and ml_dtypes': bfloat16 E, FP8 4 and 5); a message's tag is the index
_DTYPE_CHARS = "?bBhHiIlLqQefdgFDGE45"


def dtype_tag(dtype):
    """The tag collectives send an array of this dtype with, so a receiver can check the dtype."""
    return _DTYPE_CHARS.index(dtype.char) if dtype.char in _DTYPE_CHARS else len(_DTYPE_CHARS)


def tag_dtype(tag):
    """The dtype name a collective's tag stands for."""
    if 0 <= tag < len(_DTYPE_CHARS):
        return backend.dtype(_DTYPE_CHARS[tag]).name
    return f"tag {tag}"
