"""`python -m workbench ...`: the same as the `workbench` command."""

from .cli import main
from .cli.fast_exit import exit_now

exit_now(main())
