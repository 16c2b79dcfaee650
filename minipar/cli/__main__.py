"""``python -m minipar.cli``: the same as the ``minipar`` command."""
from minipar.cli import main

raise SystemExit(main())
