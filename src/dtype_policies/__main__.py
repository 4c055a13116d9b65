"""`python -m dtype_policies` runs the command line."""

from dtype_policies.cli import entry_point

entry_point()
