"""Old path of :mod:`minipar.cli.schedule`."""
from minipar.cli.schedule import add_arguments, run, summary  # noqa: F401
