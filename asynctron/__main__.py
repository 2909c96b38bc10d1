"""`python -m asynctron`: the `asynctron` command line (see `asynctron.cli`)."""

from asynctron.cli import main

raise SystemExit(main())
