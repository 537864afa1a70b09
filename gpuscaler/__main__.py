"""`python -m gpuscaler` is the `gpuscaler` console script."""

from gpuscaler.cli import main

raise SystemExit(main())
