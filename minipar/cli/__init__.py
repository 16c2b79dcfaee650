"""The ``minipar`` command. Each subcommand is a module of this package, registered here.

    minipar lessons              list the lesson scripts and how to run them
    minipar lesson 04 -n 4       run one lesson with the right launcher flags
    minipar doctor               check the MPI setup and print each problem's fix
    minipar <sub> --help         help for any subcommand

A subcommand module provides ``add_arguments(parser)`` and ``run(args) -> int``; add it to
``SUBCOMMANDS`` below (name -> (module, one-line help)). Modules are imported only when the parser
is built, so ``import minipar.cli`` stays cheap. A bad argument is an argparse error
(cli/args.py): a check in ``run`` raises ``UsageError("argument --x: ...")`` and ``main`` turns it
into the subcommand's ``error:`` line and exit status 2.
"""
import importlib
import os
import sys

from minipar.cli.args import ArgumentParser, UsageError

SUBCOMMANDS = {
    "lessons": ("minipar.cli.lessons", "list the lesson scripts and how to run them"),
    "lesson": ("minipar.cli.lesson", "run one lesson by number or name: lesson 04 -n 4"),
    "doctor": ("minipar.cli.doctor", "check MPI, the launcher, BLAS threads and GPUs; print fixes"),
    "bench": ("minipar.cli.bench", "benchmark collectives against MPI's own: bench allreduce"),
    "groups": ("minipar.cli.groups", "print the rank grid (dp x cp x tp x pp, ep within dp x cp) and its groups"),
    "schedule": ("minipar.cli.schedule", "draw a pipeline schedule, its bubble and in-flight micro-batches"),
    "plan": ("minipar.cli.plan", "predict memory and step time of a layout, or rank them all"),
    "assignment": ("minipar.cli.assignment", "assignments: list the tasks, make a student tree, pack it, grade it"),
}


def build_parser():
    parser = ArgumentParser(prog="minipar", description=__doc__.splitlines()[0])
    subs = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub = subs.add_parser(name, help=help_text, description=help_text)
        module = importlib.import_module(module_name)
        module.add_arguments(sub)
        sub.set_defaults(_run=module.run, _parser=sub)
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 0
    try:
        return int(args._run(args) or 0)
    except UsageError as err:
        args._parser.error(str(err))
    except BrokenPipeError:  # `minipar lessons | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
