"""`python -m k3stream` (what `torchrun -m k3stream` runs): the command line."""

from k3stream.cli import main

raise SystemExit(main())
