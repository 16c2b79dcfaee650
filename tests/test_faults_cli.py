"""Every bad argument of the ``minipar`` command is an argparse error, run as a student would:
exit status 2, the usage and one ``error:`` line naming the argument on standard error, nothing
on standard output, no traceback, within seconds; ``minipar bench`` refuses before it launches
mpiexec, and under mpiexec the job says it once. Big sizes answer fast or are refused, and
``--json`` prints one JSON document and nothing else.

Each case is its own ``python -m minipar.cli`` process (a timeout bounds it); the cases start
together, a few at a time, and each test reads its case's result. ``pytest -s`` prints the table
of cases and the seconds each took.
"""
import json
import os
import pathlib
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from minipar.testing import RANK_ENV, mpiexec

ROOT = pathlib.Path(__file__).resolve().parent.parent
LIMIT = 60  # seconds a case may take: about 0.3 s alone; a hang never ends, a busy machine does

BAD = {  # id: (arguments after `python -m minipar.cli`, the start of the error line)
    "bench -n 0": ("bench allreduce -n 0", "minipar bench: error: argument -n/--nprocs: must be a "
                                           "positive integer, got 0"),
    "bench -n -2": ("bench allreduce -n -2", "minipar bench: error: argument -n/--nprocs:"),
    "bench -n x": ("bench allreduce -n x", "minipar bench: error: argument -n/--nprocs:"),
    "bench --sizes 0": ("bench allreduce --sizes 0", "minipar bench: error: argument --sizes: "
                                                     "must be comma-separated sizes in bytes"),
    "bench --sizes abc": ("bench allreduce --sizes abc", "minipar bench: error: argument --sizes:"),
    "bench --sizes 8,-4": ("bench allreduce --sizes 8,-4", "minipar bench: error: argument --sizes:"),
    "bench --sizes 2**40": ("bench allreduce --sizes 1099511627776",
                            "minipar bench: error: argument --sizes: 1099511627776 bytes is above"),
    "bench --max-bytes -1": ("bench allreduce --max-bytes -1",
                             "minipar bench: error: argument --max-bytes: must be a positive"),
    "bench --max-bytes 4": ("bench allreduce --max-bytes 4",
                            "minipar bench: error: argument --max-bytes: no size is <= "),
    "bench unknown algorithm": ("bench allreduce --algorithms ring,rign",
                                "minipar bench: error: argument --algorithms: unknown all-reduce "
                                "algorithm 'rign': choose from hierarchical, mpi, parallel, "),
    "bench --slow-max -1": ("bench allreduce --slow-max -1",
                            "minipar bench: error: argument --slow-max: must be an integer >= 0"),
    "bench without allreduce": ("bench", "minipar bench: error: the following arguments are "
                                         "required: what"),
    "schedule 0 stages": ("schedule --schedule 1f1b --stages 0 --microbatches 4",
                          "minipar schedule: error: argument --stages: must be a positive"),
    "schedule 0 micro-batches": ("schedule --schedule gpipe --stages 4 --microbatches 0",
                                 "minipar schedule: error: argument --microbatches: must be a"),
    "schedule 0 chunks": ("schedule --schedule interleaved --stages 4 --microbatches 8 --chunks 0",
                          "minipar schedule: error: argument --chunks: must be a positive"),
    "schedule stages abc": ("schedule --schedule 1f1b --stages abc --microbatches 4",
                            "minipar schedule: error: argument --stages: must be a positive"),
    "schedule chunks with 1f1b": ("schedule --schedule 1f1b --stages 4 --microbatches 8 --chunks 2",
                                  "minipar schedule: error: argument --chunks: only the "
                                  "interleaved schedules (interleaved, zb-interleaved) take chunks"),
    "schedule m not a multiple of p": ("schedule --schedule interleaved --stages 4 "
                                       "--microbatches 6", "minipar schedule: error: argument "
                                       "--microbatches: interleaved 1F1B sends micro-batches in "
                                       "groups of p: m=6 must be a multiple of p=4 (try m=8)"),
    "schedule remat with 1f1b": ("schedule --schedule 1f1b --stages 2 --microbatches 4 --remat",
                                 "minipar schedule: error: argument --remat:"),
    "schedule unknown schedule": ("schedule --schedule 2f2b --stages 2 --microbatches 4",
                                  "minipar schedule: error: argument --schedule: invalid choice"),
    "schedule 1000 x 100000": ("schedule --schedule 1f1b --stages 1000 --microbatches 100000",
                               "minipar schedule: error: argument --stages: 1000 stages is above "
                               "this command's limit of 64"),
    "schedule 64 x 2048": ("schedule --schedule zb-h1 --stages 64 --microbatches 2048",
                           "minipar schedule: error: argument --microbatches: stages × "
                           "micro-batches × chunks = 64 × 2048 × 1 = 131072 is above this "
                           "command's limit of 65536"),
    "schedule 32 x 512 x 8": ("schedule --schedule interleaved --stages 32 --microbatches 512 "
                              "--chunks 8", "minipar schedule: error: argument --microbatches: "
                                            "stages × micro-batches × chunks = 32 × 512 × 8"),
    "schedule --png in no folder": ("schedule --schedule 1f1b --stages 2 --microbatches 2 --png "
                                    "/nonexistent/x.png", "minipar schedule: error: argument "
                                    "--png: cannot write /nonexistent/x.png: No such file"),
    "schedule --trace a folder": ("schedule --schedule 1f1b --stages 2 --microbatches 2 --trace "
                                  "tests", "minipar schedule: error: argument --trace: cannot "
                                           "write tests: Is a directory"),
    "groups --world 0": ("groups --world 0", "minipar groups: error: argument --world: must be a "
                                             "positive integer, got 0"),
    "groups --world abc": ("groups --world abc", "minipar groups: error: argument --world:"),
    "groups --tp 0": ("groups --world 8 --tp 0", "minipar groups: error: argument --tp: must be"),
    "groups --pp -1": ("groups --world 8 --pp -1", "minipar groups: error: argument --pp: must be"),
    "groups not divisible": ("groups --world 10 --tp 4", "minipar groups: error: argument --world: "
                                                         "world size 10 is not divisible by tp·pp"),
    "groups bad order": ("groups --world 8 --order tp-dp", "minipar groups: error: argument "
                                                           "--order: invalid choice: 'tp-dp'"),
    "groups --rank outside": ("groups --world 8 --rank 8", "minipar groups: error: argument "
                                                           "--rank: rank 8 is outside the world"),
    "groups above the limit": ("groups --world 1048576", "minipar groups: error: argument --world: "
                                                         "1048576 ranks is above this command's "
                                                         "limit of 131072"),
    "unknown subcommand": ("grups --world 8", "minipar: error: argument COMMAND: invalid choice"),
}

GOOD = {  # id: arguments of a command that must succeed within LIMIT seconds
    "groups 16384 text": "groups --world 16384 --tp 2 --pp 4",
    "groups 16384 json": "groups --world 16384 --tp 2 --pp 4 --json",
    "groups 16384 one rank": "groups --world 16384 --tp 8 --pp 16 --rank 5000 --json",
    "schedule at the limit": "schedule --schedule 1f1b --stages 64 --microbatches 64",
    "schedule json": "schedule --schedule interleaved --stages 4 --microbatches 8 --json "
                     "--trace {tmp}/t.json --png {tmp}/t.png",
}


def launch(command, env=None):
    """(exit status, stdout, stderr, seconds) of one command, killed after LIMIT seconds."""
    start = time.perf_counter()
    env = {**os.environ, **RANK_ENV, "PYTHONPATH": str(ROOT), **(env or {})}
    for name in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                 "PMIX_RANK", "MPI_LOCALNRANKS"):  # as a student's shell: not inside an MPI job
        env.pop(name, None)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=LIMIT, env=env,
                              cwd=ROOT)
    except subprocess.TimeoutExpired:
        return None, "", f"still running after {LIMIT} s", LIMIT
    return done.returncode, done.stdout, done.stderr, time.perf_counter() - start


def cli(arguments):
    return [sys.executable, "-m", "minipar.cli", *arguments.split()]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every case of BAD and GOOD, run three at a time: id -> (status, out, err, seconds)."""
    tmp = tmp_path_factory.mktemp("cli")
    cases = {**{k: cli(a) for k, (a, _) in BAD.items()},
             **{k: cli(a.format(tmp=tmp)) for k, a in GOOD.items()}}
    with ThreadPoolExecutor(3) as pool:
        found = dict(zip(cases, pool.map(launch, cases.values())))
    print("\ncase                                 exit  seconds")
    for name, (status, _, _, seconds) in found.items():
        print(f"{name:36s} {status!s:>4s}  {seconds:7.2f}")
    return found


def assert_argparse_error(status, out, err, seconds, expected):
    assert status == 2, f"exit status {status}, expected 2; stderr:\n{err}"
    assert "Traceback" not in out + err, err
    assert out == "", f"something on standard output: {out!r}"
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and err.splitlines()[-1] == errors[0], err
    assert errors[0].startswith(expected), f"{errors[0]!r} does not start with {expected!r}"
    assert err.startswith("usage: ")
    assert seconds < LIMIT


@pytest.mark.parametrize("case", list(BAD))
def test_bad_argument_is_an_argparse_error(results, case):
    assert_argparse_error(*results[case], BAD[case][1])


def test_bench_refuses_before_launching_mpiexec(results):
    """A launched job would print its MPI header or a rank's traceback; nothing of it is there."""
    for case in (c for c in BAD if c.startswith("bench")):
        status, out, err, _ = results[case]
        assert "rank" not in err.lower() and "mpi" not in out.lower()


def test_groups_16384_answers_in_seconds_with_a_summary(results):
    status, out, err, seconds = results["groups 16384 text"]
    assert status == 0 and err == "" and seconds < LIMIT
    assert out.startswith("world 16384 = tp 2 × dp 2048 × pp 4")
    assert "  ... (16368 more ranks) ..." in out
    assert "tensor groups (8192 of 2): [0,1] [2,3] [4,5] [6,7] ... (8184 more groups) ..." in out
    assert len(out.splitlines()) < 40


def test_groups_json_is_one_document(results):
    status, out, err, seconds = results["groups 16384 json"]
    assert status == 0 and err == "" and seconds < LIMIT
    grid = json.loads(out)  # the whole of standard output is one JSON document
    assert len(grid["tensor"]) == 8192 and len(grid["coords"]) == 16384
    assert grid["pipeline"][-1] == [4095, 8191, 12287, 16383]
    status, out, err, seconds = results["groups 16384 one rank"]
    assert status == 0 and err == "" and seconds < LIMIT
    one = json.loads(out)
    assert one["coords"] == {"tp": 0, "dp": 113, "pp": 4}
    assert one["tensor"] == list(range(5000, 5008)) and 5000 in one["data"]
    assert one["pipeline"] == list(range(5000 % 1024, 16384, 1024))


def test_schedule_at_its_limit_is_fast_and_json_is_pure(results):
    status, out, err, seconds = results["schedule at the limit"]
    assert status == 0 and err == "" and seconds < LIMIT
    assert "1f1b: p=64 ranks, m=64 micro-batches" in out
    status, out, err, seconds = results["schedule json"]
    assert status == 0 and err == "" and seconds < LIMIT
    assert json.loads(out)["chunks"] == 2  # no "wrote t.png" after the document


BENCH = "--sizes 8 --algorithms ring --slow-max 0"


@pytest.mark.fault
@pytest.mark.mpi
def test_bench_under_mpiexec_says_a_bad_argument_once():
    """``mpiexec -n 2 python -m minipar.bench``: each rank finds the error, rank 0 prints it."""
    for arguments, expected in [("-n 0", "argument -n/--nprocs: must be a positive integer"),
                                ("--sizes abc", "argument --sizes: must be comma-separated"),
                                ("--algorithms rign", "argument --algorithms: unknown all-reduce "
                                                      "algorithm 'rign': choose from ")]:
        command = [mpiexec(), "-n", "2", sys.executable, "-m", "minipar.bench",
                   *arguments.split()]
        status, out, err, seconds = launch(command)
        print(f"mpiexec -n 2 python -m minipar.bench {arguments}: exit {status}, {seconds:.2f} s")
        assert_argparse_error(status, out, err, seconds,
                              f"python -m minipar.bench: error: {expected}")


@pytest.mark.fault
@pytest.mark.mpi
def test_bench_json_is_one_document_with_notes_on_stderr():
    status, out, err, seconds = launch(cli(f"bench allreduce -n 2 {BENCH} --json"))
    print(f"minipar bench allreduce -n 2 {BENCH} --json: exit {status}, {seconds:.2f} s")
    assert status == 0 and seconds < LIMIT, err
    report = json.loads(out)
    assert report["header"]["p"] == 2
    assert [(r["bytes"], r["algorithm"], r["wrong"]) for r in report["rows"]] == [
        (8, "mpi", 0), (8, "ring", 0)]
    command = [mpiexec(), "-n", "2", sys.executable, "-m", "minipar.bench", "-n", "3", *BENCH.split(),
               "--json"]
    status, out, err, seconds = launch(command)
    print(f"mpiexec -n 2 python -m minipar.bench -n 3 {BENCH} --json: exit {status}, "
          f"{seconds:.2f} s")
    assert status == 0 and seconds < LIMIT, err
    assert json.loads(out)["header"]["p"] == 2
    assert err.count("-n 3 ignored: measuring the 2 ranks mpiexec started") == 1
