"""``minipar groups``: print the rank grid of data × tensor × pipeline parallelism.

    minipar groups --world 16 --tp 2 --pp 4            each rank's coordinates and every group
    minipar groups --world 16 --tp 2 --pp 4 --json     {"tensor": [[...]], "pipeline": ..., "data": ...}
"""
import json

from minipar.parallel.groups import RankGrid


def add_arguments(parser):
    parser.add_argument("--world", type=int, required=True, help="number of ranks W")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    parser.add_argument("--order", default="tp-dp-pp",
                        help="fastest-varying coordinate first (default Megatron's tp-dp-pp)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def run(args):
    try:
        grid = RankGrid(args.world, tp=args.tp, pp=args.pp, order=args.order)
    except ValueError as e:
        raise SystemExit(f"minipar groups: {e}")
    grid.check()
    print(json.dumps(grid.as_dict()) if args.json else grid.describe())
    return 0
