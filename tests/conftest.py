"""Shared pytest set-up. Multi-rank tests launch ranks through minipar.testing.run_on_ranks."""
import os
import sys

import pytest

# Ranks share a few cores: one BLAS thread per process (the harness sets this for ranks too).
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _same_device_for_every_test():
    """A test that switches the device (``backend.set_device``) hands the next test the run's
    device back: a run under MINIPAR_DEVICE=strict stays strict from the first test to the last."""
    from minipar import backend

    saved = dict(backend._state)
    yield
    backend._state.update(saved)
