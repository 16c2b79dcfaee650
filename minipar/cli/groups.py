"""``minipar groups``: print the rank grid of up to five axes, tp × cp × ep × dp × pp.

    minipar groups --world 16 --tp 2 --pp 4            each rank's coordinates and every group
    minipar groups --world 16 --tp 2 --pp 4 --json     {"tensor": [[...]], "pipeline": ..., "data": ...}
    minipar groups --world 16 --tp 2 --pp 2 --ep 2     + expert and expert-data groups (ep | dp)
    minipar groups --world 16 --tp 2 --cp 2 --pp 2     + context groups (Megatron's tp-cp-ep-dp-pp)
    minipar groups --world 16 --tp 2 --cp 2 --pp 2 --ep 2     all five axes (ep splits dp·cp)
    minipar groups --world 16384 --tp 8 --pp 16 --rank 5000     one rank's coordinates and groups

Above 64 ranks the text shows the first and last ranks and groups (``--full`` prints them all);
``--json`` always gives every group. Up to 131,072 ranks (2^17, about a second; RankGrid itself
has no limit); a larger --world is an argparse error, as is every other bad size.
"""
import json

from minipar.cli.args import UsageError, nonnegative_int, positive_int
from minipar.parallel.groups import DENSE, EXPERT, KEYS, KINDS, RankGrid, orders

MAX_WORLD = 1 << 17  # 131,072 ranks: more than today's largest training jobs; ~1 s, 8 MB of JSON
ORDERS = orders()


def add_arguments(parser):
    parser.add_argument("--world", type=positive_int, required=True,
                        help=f"number of ranks W (at most {MAX_WORLD})")
    parser.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size")
    parser.add_argument("--pp", type=positive_int, default=1, help="pipeline-parallel size")
    parser.add_argument("--cp", type=positive_int, default=1,
                        help="context-parallel size: each sequence cut over cp ranks")
    parser.add_argument("--ep", type=positive_int, default=1,
                        help="expert-parallel size: splits each data-context (dp·cp) group, "
                             "as Megatron's expert grid (must divide dp·cp)")
    parser.add_argument("--order", default="tp-dp-pp", choices=ORDERS, metavar="ORDER",
                        help="fastest-varying coordinate first: tp, dp and pp in any order, "
                             "ep and cp (if named) beside dp (default Megatron's tp-dp-pp, which "
                             "puts ep just before dp and cp before both: tp-cp-ep-dp-pp)")
    parser.add_argument("--rank", type=nonnegative_int, default=None,
                        help="show only this rank's coordinates and groups")
    parser.add_argument("--full", action="store_true",
                        help="print every rank and group, however many (text output)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def run(args):
    if args.world > MAX_WORLD:
        raise UsageError(f"argument --world: {args.world} ranks is above this command's limit of "
                         f"{MAX_WORLD}")
    if args.rank is not None and args.rank >= args.world:
        raise UsageError(f"argument --rank: rank {args.rank} is outside the world of "
                         f"{args.world} ranks (0..{args.world - 1})")
    try:
        grid = RankGrid(args.world, tp=args.tp, pp=args.pp, order=args.order, ep=args.ep,
                        cp=args.cp)
    except ValueError as err:  # the parser checks sizes and order: W % (tp·cp·pp), dp·cp % ep left
        tiled = args.world % (args.tp * args.cp * args.pp) == 0
        which = "--ep" if tiled else "--world"
        raise UsageError(f"argument {which}: {err}") from None
    grid.check()
    if args.rank is not None:
        print(json.dumps(one_rank(grid, args.rank)) if args.json
              else describe_rank(grid, args.rank))
    else:
        print(json.dumps(grid.as_dict()) if args.json else grid.describe(full=args.full))
    return 0


def one_rank(grid, rank):
    """{'rank': r, 'coords': {...}, 'tensor': [...], 'pipeline': [...], 'data': [...]}, and
    'context', 'tensor_context', 'data_context' when cp > 1, 'expert', 'expert_data' when ep > 1."""
    return {"rank": rank, "coords": grid.all_coords(rank),
            **{KEYS[kind]: grid.group_of(rank, kind) for kind in grid.shown(KINDS)}}


def describe_rank(grid, rank):
    c = grid.all_coords(rank)
    coords = " ".join(f"{k} {c[k]}" for k in grid.shown(DENSE + EXPERT))
    lines = [grid.title(), f"rank {rank}: {coords}"]
    for kind in grid.shown(KINDS):
        group = grid.group_of(rank, kind)
        lines.append(f"{KINDS[kind]} group ({len(group)} ranks): " + str(group).replace(" ", ""))
    return "\n".join(lines)
