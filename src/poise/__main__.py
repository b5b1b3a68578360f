"""`python -m poise`: the `poise` command line (`poise.cli.main`)."""

from poise.cli import main

raise SystemExit(main())
