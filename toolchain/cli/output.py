"""The CLI's one output helper: the two consoles, JSON, sizes, and progress bars. Every command prints
through here, so `--json` output, widths and progress behave the same everywhere.

Progress goes to stderr and only to a terminal (and never with --json), so piped stdout stays clean."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import click
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TransferSpeedColumn,
)

out = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def emit_json(obj: Any) -> None:
    """The one JSON format of every --json: indented, keys sorted."""
    click.echo(json.dumps(obj, indent=2, sort_keys=True))


def mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 1024:,.1f} KiB"


def bytes_bar(disable: bool) -> Progress:
    """A progress bar that counts bytes (hashing, copying)."""
    return Progress(
        TextColumn("{task.description:<40}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=disable or not err.is_terminal,
    )


def steps_bar(label: str, unit: str, disable: bool = False, *extra: TextColumn) -> Progress:
    """A progress bar over counted steps: `label [bar] done/total unit`."""
    return Progress(
        TextColumn(label),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} " + unit),
        *extra,
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=disable,
    )


@contextmanager
def download_bar(quiet: bool) -> Iterator[Callable[[int, int | None], None]]:
    """A progress callback (done, total) for downloads, drawing a bar on stderr."""
    with Progress(
        TextColumn("downloading"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=err,
        transient=True,
        disable=quiet,
    ) as bar:
        task = bar.add_task("fetch", total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total or None)
