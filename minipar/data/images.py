"""The UCI handwritten digits, bundled: 1797 grey 8×8 images of the digits 0-9.

Source: E. Alpaydin and C. Kaynak, "Optical Recognition of Handwritten Digits", UCI Machine
Learning Repository (1998), https://doi.org/10.24432/C50P49, licensed CC BY 4.0; this copy (the
UCI test set) is the one scikit-learn ships as ``load_digits``. Each image counts the "on" pixels
of 4×4 blocks of a 32×32 bitmap, so pixels are integers 0..16. Stored as ``digits.npz``
(images uint8 (1797, 8, 8), labels uint8 (1797,)).
"""
import pathlib

from .. import backend

_PATH = pathlib.Path(__file__).resolve().parent / "digits.npz"


def load_digits(scale=True):
    """``(images, labels)`` as host NumPy arrays: images float32 (1797, 1, 8, 8) in [0, 1] when
    ``scale`` (else uint8 0..16, shape (1797, 8, 8)), labels int64 (1797,)."""
    with backend.get_array_module().load(_PATH) as f:  # no arrays given: NumPy
        images, labels = f["images"], f["labels"].astype("int64")
    if scale:
        images = (images.astype("float32") / 16.0)[:, None]
    return images, labels
