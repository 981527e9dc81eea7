"""``python -m gss`` (and ``torchrun -m gss``) runs the CLI."""

from gss.cli import main

raise SystemExit(main())
