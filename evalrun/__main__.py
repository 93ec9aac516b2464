"""`python -m evalrun ...`: the same program as the `evalrun` script."""
from evalrun.commands.cli import main

raise SystemExit(main())
