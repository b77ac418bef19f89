"""`python -m workbench ...`: the same as the `workbench` command."""

from .cli import main

raise SystemExit(main())
