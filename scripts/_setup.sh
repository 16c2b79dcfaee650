# Sourced by scripts/demo and scripts/test: create (or reuse) .venv and install minipar into it.
# Needs only python3 (3.9+) and the package registry; MPI comes from the mpich wheel, no root needed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MINIPAR_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
if [ ! -x "$PY" ]; then
    echo "[setup] creating virtual environment $VENV"
    python3 -m venv "$VENV"
fi
# Reinstall only when the package metadata changed since the last install.
STAMP="$VENV/.minipar-installed"
EXTRAS="${MINIPAR_EXTRAS:-mpi,dev}"
if [ ! -f "$STAMP" ] || [ "$ROOT/setup.cfg" -nt "$STAMP" ] || [ "$(cat "$STAMP")" != "$EXTRAS" ]; then
    echo "[setup] installing minipar[$EXTRAS] into $VENV"
    "$PY" -m pip install --quiet --upgrade pip
    "$PY" -m pip install --quiet -e "$ROOT[$EXTRAS]"
    echo "$EXTRAS" > "$STAMP"
fi
# Optional PyTorch oracle for the tests and benchmarks (never a runtime dependency).
if [ "${MINIPAR_TORCH:-0}" = "1" ] && ! "$PY" -c "import torch" 2>/dev/null; then
    echo "[setup] installing torch==2.13.0 (CPU) as a test oracle"
    "$PY" -m pip install --quiet torch==2.13.0 || echo "[setup] torch not installed: its comparisons will be skipped"
fi
export PATH="$VENV/bin:$PATH"
# One BLAS thread per process: ranks share a few cores, oversubscribed threads only fight.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}" \
       MKL_NUM_THREADS="${MKL_NUM_THREADS:-1}"
cd "$ROOT"
