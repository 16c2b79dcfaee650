"""Old path of :mod:`minipar.cli.groups`."""
from minipar.cli.groups import add_arguments, run  # noqa: F401
