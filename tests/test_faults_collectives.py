"""Every collective under the fingerprints and the watchdog (issue 22, item 4): each mistake of
this file is a clear error on every rank, or a named hang, within seconds with the watchdog at
MINIPAR_TIMEOUT=10, where it was a hang until the watchdog, a hang for ever, or a silently wrong
answer. Each case runs as a plain ``mpiexec`` job on 2 ranks, as in test_faults_comm.py.

The seconds each job took are printed with ``pytest -s``."""
import textwrap

import pytest

from minipar.testing import run_job

pytestmark = [pytest.mark.mpi, pytest.mark.fault]

BOUND = 10.0  # seconds a job may take to end, start-up included (generous: shared machines)

PRELUDE = """
import sys
import numpy as np
from minipar import comm


def on_every_rank(world, call):
    # the error each rank raises, printed by each; then the job fails (status 1)
    try:
        call()
    except Exception as error:
        print(f"rank {world.rank} raised {type(error).__name__}: {error}", flush=True)
        world.barrier()
        sys.exit(1)
    print(f"rank {world.rank} raised nothing", flush=True)
"""

EVERY_RANK = ["rank 0 raised CommError", "rank 1 raised CommError"]

MIXED = """
world = comm.world()
x = np.ones(10)
if world.rank {all_reduce_on}:  # these ranks all-reduce, the others broadcast
    world.all_reduce(x)
else:
    world.broadcast(x, root=0)
print("second all-reduce gives", world.all_reduce(np.ones(10))[0])
"""

CASES = {
    # name: (body run on every rank, expected words in the output)
    "auto all_reduce on one rank, broadcast on the other": (
        MIXED.format(all_reduce_on="== 0"),
        ["CommError", "collectives differ across ranks", "broadcast #0", "all_reduce #0"]),
    "a rank skips all_gather_object": ("""
world = comm.world()
if world.rank == 0:
    world.all_gather_object("hello")
""", ["reached the end of its program while rank 0 still waits for it",
      "all_gather_object"]),
    "only rank 0 wraps the model in DDP": ("""
from minipar import nn
from minipar.parallel.data import DistributedDataParallel
world = comm.world()
if world.rank == 0:
    DistributedDataParallel(nn.Linear(3, 2), world)
""", ["reached the end of its program while rank 0 still waits for it",
      "all_gather_object"]),
    "a rank skips new_group": ("""
import minipar.distributed as dist
dist.init_process_group("mpi")
if dist.get_rank() == 0:
    dist.new_group([0, 1])
""", ["reached the end of its program while rank 0 still waits for it", "group"]),
    "a rank skips the async mpi all-reduce": ("""
world = comm.world()
if world.rank == 0:
    world.iall_reduce(np.ones(4), algorithm="mpi").wait()
""", ["reached the end of its program while rank 0 still waits for it", "MPI"]),
    "async mpi with int32 on one rank and float32 on the other": ("""
world = comm.world()
x = np.ones(4, "int32" if world.rank == 0 else "float32")
on_every_rank(world, lambda: print("sum", world.iall_reduce(x, algorithm="mpi").wait()))
""", EVERY_RANK + ["disagree on an MPI collective", "dtypes differ across ranks"]),
    "async mpi with 4 elements on one rank and 6 on the other": ("""
world = comm.world()
x = np.ones(4 if world.rank == 0 else 6)
on_every_rank(world, lambda: print("sum", world.iall_reduce(x, algorithm="mpi").wait()))
""", EVERY_RANK + ["disagree on an MPI collective", "counts or roots differ across ranks"]),
    "mpi all_to_all_v where rank 1 expects more rows than rank 0 sends": ("""
world = comm.world()
x = np.arange(4.0).reshape(2, 2)
recv = [2, 1] if world.rank == 1 else [1, 1]
on_every_rank(world, lambda: print(world.all_to_all_v(x, [1, 1], recv, algorithm="mpi")))
""", EVERY_RANK + ["rank 1 expects 2 rows from rank 0, which sends it 1"]),
    "ExpertParallelMoE ranks that disagree on top_k": ("""
from minipar.parallel.expert import ExpertParallelMoE
world = comm.world()
on_every_rank(world, lambda: ExpertParallelMoE(8, 4, top_k=1 + world.rank, group=world))
""", EVERY_RANK + ["ExpertParallelMoE: the ranks disagree on top_k (rank 0: 1, rank 1: 2)"]),
    "ExpertParallelMoE ranks that disagree on capacity_factor": ("""
from minipar.parallel.expert import ExpertParallelMoE
world = comm.world()
cf = 1.25 if world.rank == 0 else None
on_every_rank(world, lambda: ExpertParallelMoE(8, 4, capacity_factor=cf, group=world))
""", EVERY_RANK + ["the ranks disagree on capacity_factor (rank 0: 1.25, rank 1: None)"]),
    "Trainer4D data ranks that disagree on top_k": ("""
from minipar import nn
from minipar.parallel.groups import ParallelGroups
from minipar.parallel.hybrid4d import Trainer4D
from minipar.parallel.tensor.moe import MoEConfig
world = comm.world()
gpt = nn.GPTConfig(vocab_size=16, block_size=8, n_head=2, n_embd=16, n_layer=2)
moe = MoEConfig(n_experts=2, top_k=1 + world.rank)
on_every_rank(world, lambda: Trainer4D(gpt, moe, ParallelGroups(world)))  # ep=1: dp=2
""", EVERY_RANK + ["Trainer4D: the ranks disagree on top_k (rank 0: 1, rank 1: 2)"]),
    "Trainer4D ranks that disagree on capacity_factor": ("""
from minipar import nn
from minipar.parallel.groups import ParallelGroups
from minipar.parallel.hybrid4d import Trainer4D
from minipar.parallel.tensor.moe import MoEConfig
world = comm.world()
gpt = nn.GPTConfig(vocab_size=16, block_size=8, n_head=2, n_embd=16, n_layer=2)
moe = MoEConfig(n_experts=2, capacity_factor=1.0 + world.rank)
on_every_rank(world, lambda: Trainer4D(gpt, moe, ParallelGroups(world, ep=2)))
""", EVERY_RANK + ["the ranks disagree on capacity_factor (rank 0: 1.0, rank 1: 2.0)"]),
}


# On 3 ranks of one node ``auto`` picks the shared-memory all-reduce (comm/shm.py), whose
# barriers are MPI's: its ranks meet by trading the call's fingerprint in messages instead
SHM_CASES = {
    "auto all_reduce (shm) on rank 0, broadcast on ranks 1 and 2": (
        MIXED.format(all_reduce_on="== 0"),
        ["CommError", "collectives differ across ranks", "broadcast #0 (binomial",
         "all_reduce #0 (shm"]),
    "broadcast on rank 1, auto all_reduce (shm) on ranks 0 and 2": (
        MIXED.format(all_reduce_on="!= 1"),
        ["CommError", "collectives differ across ranks", "broadcast #0 (binomial",
         "all_reduce #0 (shm"]),
    "shm all_reduce on 3 ranks, rank 2 with another dtype": ("""
world = comm.world()
x = np.ones(8, "float64" if world.rank == 2 else "float32")
on_every_rank(world, lambda: print("sum", world.all_reduce(x, algorithm="shm")))
""", EVERY_RANK + ["rank 2 raised CommError", "dtypes differ across ranks"]),
}


# two "nodes" of two ranks (MINIPAR_RANKS_PER_NODE=2): the mismatch reaches across nodes, where
# the hierarchical all-reduce's barriers and leaders' exchange are MPI's own
NODES_CASES = {
    "hierarchical on one node, ring on the other, at the first call": ("""
world = comm.world()
x = np.ones(1000)
world.all_reduce(x, algorithm="hierarchical" if world.rank < 2 else "ring")
""", ["CommError", "all_reduce #0 (ring, sum, float64)",
      "all_reduce #0 (hierarchical, sum, float64)", "algorithms differ across ranks"]),
    "hierarchical on one node, ring on the other, at the second call": ("""
world = comm.world()
x = np.ones(1000)
world.all_reduce(x, algorithm="hierarchical")
world.all_reduce(x, algorithm="hierarchical" if world.rank < 2 else "ring")
""", ["CommError", "all_reduce #1 (ring, sum, float64)",
      "all_reduce #1 (hierarchical, sum, float64)", "algorithms differ across ranks"]),
}


@pytest.mark.parametrize("case", NODES_CASES)
def test_a_mismatch_across_nodes_names_both_calls(case):
    body, words = NODES_CASES[case]
    status, output, seconds = run_job(PRELUDE + textwrap.dedent(body), 4, timeout=60,
                                      env={"MINIPAR_TIMEOUT": "10", "MINIPAR_RANKS_PER_NODE": "2"})
    print(f"\n{case}: exit status {status}, ended in {seconds:.1f} s")
    assert status not in (None, 0), f"{case}: the job did not fail (status {status}):\n{output}"
    missing = [w for w in words if w not in output]
    assert not missing, f"{case}: {missing} not in the output:\n{output}"
    assert "minipar watchdog" not in output, output  # the CommError, not the watchdog, ends it
    # four ranks start on two cores: twice the two-rank jobs' bound
    assert seconds < 2 * BOUND, f"{case}: the job took {seconds:.1f} s to end:\n{output}"


@pytest.mark.parametrize("case,nprocs", [(case, 2) for case in CASES]
                         + [(case, 3) for case in SHM_CASES])
def test_the_job_ends_with_a_message_naming_the_problem(case, nprocs):
    body, words = {**CASES, **SHM_CASES}[case]
    status, output, seconds = run_job(PRELUDE + textwrap.dedent(body), nprocs, timeout=60,
                                      env={"MINIPAR_TIMEOUT": "10"})
    print(f"\n{case}: exit status {status}, ended in {seconds:.1f} s")
    assert status not in (None, 0), f"{case}: the job did not fail (status {status}):\n{output}"
    missing = [w for w in words if w not in output]
    assert not missing, f"{case}: {missing} not in the output:\n{output}"
    assert "second all-reduce gives" not in output, output  # no corrupted result after a mismatch
    assert "raised nothing" not in output and "sum [" not in output, output
    assert seconds < BOUND, f"{case}: the job took {seconds:.1f} s to end:\n{output}"
