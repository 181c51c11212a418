"""`python -m ingot.toolchain` runs the `ingot` CLI too (kept for scripts written against it)."""

from ingot.toolchain.cli import main

main()
