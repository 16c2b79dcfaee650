"""Old path of :mod:`minipar.cli.lessons`."""
from minipar.cli.lessons import LESSON_DIR, add_arguments, lessons, run  # noqa: F401
