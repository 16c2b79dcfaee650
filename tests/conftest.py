"""Shared pytest set-up. Multi-rank tests launch ranks through minipar.testing.run_on_ranks."""
import os
import sys

# Ranks share a few cores: one BLAS thread per process (the harness sets this for ranks too).
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
