"""``python -m quickdraft``: the same command line as the ``quickdraft`` script."""

from .cli import main

raise SystemExit(main())
