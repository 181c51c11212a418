"""The `ingot` command line, assembled here and only here.

Commands live in one module per area and are thin: parse options, call one module, print through
cli/output.py. The group below names every command and the module it lives in; a command's module is
imported only when that command runs (click's lazy-group pattern), so `ingot run` does not pay for the
kernel build or the server's imports, and `ingot --help` is instant.

    kernels.py   build, inspect, doctor, check-compat
    bundles.py   pack, verify, keygen, sign, rebuild, sbom
    models.py    run, perplexity, model fetch|synth|info
    serve.py     serve
    bench.py     bench

`main` is the one place where errors become exit codes (ingot.runtime.errors documents them).
"""

from __future__ import annotations

import importlib
import sys

import click
from rich.markup import escape

from ingot.runtime import settings
from ingot.runtime.errors import EXIT_FAILURE, EXIT_USAGE, IngotError
from ingot.toolchain.cli.output import err

# command name -> (module under ingot.toolchain.cli, attribute), in the order `ingot --help` lists them
COMMANDS: dict[str, tuple[str, str]] = {
    "build": ("kernels", "build"),
    "inspect": ("kernels", "inspect"),
    "doctor": ("kernels", "doctor"),
    "check-compat": ("kernels", "check_compat"),
    "pack": ("bundles", "pack"),
    "verify": ("bundles", "verify"),
    "keygen": ("bundles", "keygen"),
    "sign": ("bundles", "sign"),
    "rebuild": ("bundles", "rebuild"),
    "sbom": ("bundles", "sbom"),
    "run": ("models", "run"),
    "perplexity": ("models", "perplexity_command"),
    "model": ("models", "model"),
    "serve": ("serve", "serve"),
    "bench": ("bench", "bench"),
}


class LazyGroup(click.Group):
    """A group whose commands are imported on first use (see the module docstring)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        module, attr = COMMANDS[cmd_name]
        command = getattr(importlib.import_module(f"ingot.toolchain.cli.{module}"), attr)
        assert isinstance(command, click.Command), f"{module}.{attr} is not a click command"
        return command


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ingot-llm", prog_name="ingot")
def cli() -> None:
    """Ingot: build verifiable LLM inference bundles for NVIDIA GPUs, and run them.

    Exit codes: 0 ok, 1 runtime failure, 2 usage error, 3 incompatible or missing GPU/driver/toolkit,
    4 verification failed, 5 bad or unsupported model, 6 kernel build failed.
    """


def main() -> None:
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        err.print("aborted")
        sys.exit(130)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code if e.exit_code else EXIT_USAGE)
    except IngotError as e:
        err.print(f"[red]error:[/red] {escape(str(e))}")
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(0)
    except Exception as e:  # the last resort: one line, and the traceback only on request
        if _debug():
            raise
        err.print(
            f"[red]internal error:[/red] {type(e).__name__}: {escape(str(e))} (set INGOT_DEBUG=1 for a traceback)"
        )
        sys.exit(EXIT_FAILURE)


def _debug() -> bool:
    try:
        return bool(settings.DEBUG.get())
    except IngotError:
        return True
