"""Bad arguments, the argparse way: exit status 2, the usage and one ``error:`` line on standard
error, no traceback, whichever check found the problem.

    parser = ArgumentParser(prog="minipar schedule")
    parser.add_argument("--stages", type=positive_int)    # argument --stages: must be a positive ...
    try:
        run(args)                                          # run may raise UsageError("argument ...")
    except UsageError as err:
        parser.error(str(err))

``ArgumentParser.error`` raises ``ArgumentsExit``, a ``SystemExit`` with status 2 whose ``str`` is
the error line, so a caller in the same process (a test, a notebook) can read what was wrong.
Under ``mpiexec`` every rank parses the same arguments and finds the same error; only rank 0
prints it, so the job says it once, and every rank exits with status 2.
"""
import argparse
import sys


class UsageError(ValueError):
    """A bad argument (or combination) found after parsing; its text starts 'argument --name:'."""


class ArgumentsExit(SystemExit):
    """argparse's exit for a bad argument: status 2, the error line as its text."""

    def __init__(self, message):
        super().__init__(2)
        self.message = message

    def __str__(self):
        return self.message


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose errors raise ``ArgumentsExit`` and print on rank 0 only."""

    def error(self, message):
        # imported here, so that ``import minipar.cli`` stays cheap
        from minipar.distributed.process_group import launched_rank

        line = f"{self.prog}: error: {message}"
        if launched_rank() in (None, 0):
            self.print_usage(sys.stderr)
            print(line, file=sys.stderr, flush=True)
        raise ArgumentsExit(line)


def positive_int(text):
    """argparse type: an integer >= 1."""
    return _integer(text, 1, "a positive integer")


def nonnegative_int(text):
    """argparse type: an integer >= 0."""
    return _integer(text, 0, "an integer >= 0")


def _integer(text, least, what):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
    return value


def size_list(text):
    """argparse type: comma-separated sizes in bytes, each a positive integer ('8,1024,65536')."""
    sizes = []
    for item in text.split(","):
        try:
            sizes.append(positive_int(item.strip()))
        except argparse.ArgumentTypeError:
            which = f" ({item.strip()!r} is not)" if "," in text else ""
            raise argparse.ArgumentTypeError(f"must be comma-separated sizes in bytes, each a "
                                             f"positive integer, got {text!r}{which}") from None
    return sizes
