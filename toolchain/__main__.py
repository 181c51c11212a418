"""`python -m ingot.toolchain` runs the `ingot` CLI (for environments without the console script)."""
from .cli import main

main()
