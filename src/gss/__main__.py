"""``python -m gss`` (and ``torchrun -m gss``) runs the CLI."""

from .cli import main

raise SystemExit(main())
