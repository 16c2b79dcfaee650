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


# The heavy tests: whole lessons and benchmarks run end to end, assignment trees made and
# graded, the fault cases (each ends a job on purpose: test_faults_*, @pytest.mark.fault),
# torch's own runs of the ported scripts, the layouts on eight ranks (four a core here), the
# collectives of shared memory on 3 ranks and all of them on 5 and 8 (the code paths of 3 and
# 4), and FP8's 50-step band. scripts/test leaves them out, so that a laptop runs
# the suite in under 5 minutes; scripts/test --all and CI (.ci/run) run them too.
HEAVY_FILES = {
    "test_assignments.py", "test_assignments_bite.py", "test_assignments_cheats.py",
    "test_assignments_tree.py", "test_assignment_references.py",
    "test_faults_ckpt.py", "test_faults_cli.py", "test_faults_collectives.py",
    "test_faults_comm.py", "test_faults_hooks.py", "test_faults_wrappers.py",
    "test_lessons_pass.py", "test_lessons_plots.py", "test_lessons_pipeline.py",
    "test_lesson11.py", "test_lesson17.py", "test_bench_plots.py", "test_bench_gpu.py",
    "test_bench_amp.py",
    "test_torch_tutorial.py", "test_torch_ddp_script.py", "test_fsdp2_scripts.py",
    "test_pipeline_runtime_bubble.py"}
HEAVY_CASES = {"test_collectives_equal_mpi[5]", "test_collectives_equal_mpi[8]",
               "test_shared_memory_all_reduce_equals_mpi[3]",
               "test_shared_memory_all_reduce_equals_mpi[5]",
               "test_shared_memory_all_reduce_equals_mpi[8]",
               "test_fp8_training_stays_within_the_band_of_bf16"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if (item.path.name in HEAVY_FILES or item.name in HEAVY_CASES
                or "eight_ranks" in item.name or item.get_closest_marker("fault")):
            item.add_marker(pytest.mark.heavy)
