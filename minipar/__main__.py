"""``python -m minipar``: the ``minipar`` command, where its console script is not on PATH."""
from minipar.cli import main

raise SystemExit(main())
