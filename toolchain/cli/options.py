"""Options shared by several commands, defined once."""

from __future__ import annotations

import click

from ingot.runtime.engines import DEVICES

model_argument = click.argument("model_spec", metavar="MODEL")

device_option = click.option(
    "--device",
    type=click.Choice(DEVICES),
    default="auto",
    show_default=True,
    help="Engine: the GPU (cuda), the numpy reference (cpu), or cuda when a GPU is present.",
)

gpu_option = click.option(
    "--gpu",
    type=click.IntRange(min=0),
    help="GPU index (default: the one with the most free memory).",
)

unverified_option = click.option(
    "--allow-unverified",
    is_flag=True,
    help="Run a bundle even if it does not verify (prints a warning).",
)


pubkey_option = click.option(
    "--pubkey",
    "pubkeys",
    multiple=True,
    type=click.Path(dir_okay=False),
    help="Trust policy: run a bundle only if signed by this public key (repeatable; also $INGOT_TRUSTED_KEYS).",
)


def json_option(what: str = "the result"):
    return click.option("--json", "as_json", is_flag=True, help=f"Print {what} as JSON.")
