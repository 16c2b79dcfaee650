"""The check every trainer-equals-serial test makes on one rank's result of one layout."""
import numpy as np

TOLERANCE = 1e-10  # float64: the layouts only reorder sums


def assert_equals_serial(r, where, trains=True):
    """``r`` holds the layout's "losses", the serial twin's "reference" and "grad_error" (the
    largest gradient difference): equal within TOLERANCE, and the reference learns."""
    if trains:
        assert r["reference"][-1] < r["reference"][0], where  # it trains
    np.testing.assert_allclose(r["losses"], r["reference"], rtol=0, atol=TOLERANCE,
                               err_msg=str(where))
    assert r["grad_error"] < TOLERANCE, (where, r["grad_error"])
