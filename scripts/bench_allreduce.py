#!/usr/bin/env python
"""All-reduce benchmark: ``python scripts/bench_allreduce.py -n 4 [--json]`` (launches mpiexec),
or ``mpiexec -n 4 python scripts/bench_allreduce.py``. Same code as ``minipar bench allreduce``."""
import sys

from minipar.bench import main

if __name__ == "__main__":
    sys.exit(main(prog="scripts/bench_allreduce.py"))
