"""`python -m ingot` runs the `ingot` CLI (for environments without the console script)."""

from ingot.toolchain.cli import main

main()
