"""The error types every Ingot layer raises, and the exit code each maps to.

The CLI is the only place that turns these into exit codes; everything below it raises. A message is one
line that names the problem and, where there is one, the fix.

Exit codes (documented in the README):
  0  success
  1  runtime failure (a CUDA error while running, an internal error)
  2  usage error: bad arguments, missing or unreadable input file
  3  incompatible: the kernels cannot run on the GPU/driver asked about, or no GPU/driver/toolkit present
  4  verification failed: a bundle's digest, signature or structure is wrong
  5  model error: not a GGUF, truncated, or an unsupported architecture or quant type
  6  build failed: nvcc reported an error, or a fatbin lacks an arch that was asked for
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INCOMPATIBLE = 3
EXIT_VERIFY = 4
EXIT_MODEL = 5
EXIT_BUILD = 6


class IngotError(Exception):
    """Base class: a failure with a one-line, user-facing message."""

    exit_code = EXIT_FAILURE

    def __init__(self, message: str, *, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message


class UsageError(IngotError):
    exit_code = EXIT_USAGE


class IncompatibleError(IngotError):
    exit_code = EXIT_INCOMPATIBLE


class VerificationError(IngotError):
    exit_code = EXIT_VERIFY


class ModelError(IngotError):
    exit_code = EXIT_MODEL


class BuildError(IngotError):
    exit_code = EXIT_BUILD
