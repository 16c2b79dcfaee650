"""Bundled data: the text corpora, the character tokenizer, batches, and the digits images."""
import numpy as np
import pytest

import minipar
from minipar.data import CharTokenizer, get_batch, load_digits, load_text


def test_pydoc_text_is_real_english_and_deterministic():
    text = load_text("pydoc")
    assert len(text) > 100_000 and text == load_text()
    assert text.count(" the ") > 1000


def test_sonnets_and_unknown_name():
    assert "Shall I compare thee to a summer's day?" in load_text("sonnets")
    with pytest.raises(ValueError, match="sonnets"):
        load_text("wikipedia")


def test_tokenizer_round_trip():
    tok = CharTokenizer("hello world")
    ids = tok.encode("hello")
    assert tok.vocab_size == 8 and ids.dtype == np.int64
    assert tok.decode(ids) == "hello"
    with pytest.raises(ValueError, match="'z'"):
        tok.encode("zebra")


def test_get_batch_targets_are_shifted_inputs():
    data = np.arange(100)
    x, y = get_batch(data, 4, 8, rng=np.random.default_rng(0))
    x, y = minipar.to_numpy(x), minipar.to_numpy(y)
    assert x.shape == y.shape == (4, 8)
    np.testing.assert_array_equal(y, x + 1)
    minipar.manual_seed(0)
    a = minipar.to_numpy(get_batch(data, 4, 8)[0])
    minipar.manual_seed(0)
    np.testing.assert_array_equal(a, minipar.to_numpy(get_batch(data, 4, 8)[0]))
    with pytest.raises(ValueError, match="block_size"):
        get_batch(np.arange(5), 1, 8)


def test_digits():
    images, labels = load_digits()
    assert images.shape == (1797, 1, 8, 8) and images.dtype == np.float32
    assert 0 <= images.min() and images.max() == 1.0
    assert np.bincount(labels).tolist()[:3] == [178, 182, 177]
    raw, _ = load_digits(scale=False)
    assert raw.shape == (1797, 8, 8) and raw.max() == 16
