"""``minipar bench allreduce``: time every all-reduce algorithm against MPI's (minipar/bench.py)."""
from minipar import bench


def add_arguments(parser):
    parser.add_argument("what", choices=["allreduce"], help="the collective to benchmark")
    bench.add_arguments(parser)


def run(args):
    return bench.run(args)
