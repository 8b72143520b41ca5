"""What every CLI command shares: the Paths from ``--root``, and turning errors into exit codes.

Commands parse and print; the logic lives in the packages. An :class:`~llmgw.errors.LlmgwError`
becomes ``Error: <message>`` on stderr and its ``exit_code``; nothing prints a traceback for it.

Start-up: every ``llmgw`` run builds the whole command tree, so the command modules import at
their top only Typer, the standard library and this module; a command imports its package (the
agent, the control plane, the admin client, Rich) inside its function. ``llmgw ctl models`` then
loads the admin client alone, not the agent's engines, aiohttp and numpy (1.1 s of imports here
before, a CPU-second paid by every ``llmgw ctl`` a script or a test runs).
"""

from __future__ import annotations

import functools
import json
import sys
import unicodedata
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import typer

from llmgw.errors import LlmgwError
from llmgw.paths import Paths

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from llmgw.adminclient import AdminClient

P = ParamSpec("P")
R = TypeVar("R")


def typer_app(**kwargs: Any) -> typer.Typer:
    """A Typer app (or sub-app) of llmgw's CLI: ``typer.Typer(**kwargs)`` with click's plain help,
    which wraps long flags, types and defaults; Rich's panels cut them at 80 columns or in a pipe
    (``--mirror-api-list…``, ``hf:Qwen/Qwen2.5-0…``: a new user's report, 2026-12-05)."""
    return typer.Typer(rich_markup_mode=None, **kwargs)


def paths() -> Paths:
    """The Paths for this invocation (``--root`` sets ``LLMGW_ROOT`` before any command runs)."""
    return Paths.from_env()


def whole(text: str | int | None) -> int | None:
    """A whole number as typed (``5``, ``-1``), for an integer option's ``parser=``: Typer reads
    ``5.0`` as 5, where the admin API refuses ``5.0`` for a count (an operator's finding:
    ``ctl key set --rpm 5.0`` set 5 rpm).

    Raises:
        typer.BadParameter: anything else (``5.0``, ``5e1``, ``five``).
    """
    if text is None or isinstance(text, int):
        return text
    value = text.strip()
    if not value.lstrip("+-").isdigit() or not value.isascii():
        raise typer.BadParameter(f"{text!r} is not a whole number")
    return int(value)


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print ``Error: message`` to stderr and return the Exit to raise."""
    print(f"Error: {message}", file=sys.stderr)
    return typer.Exit(code)


def cli_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Decorator: an ``LlmgwError`` becomes ``Error: …`` and its exit code; Ctrl-C exits 130."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except LlmgwError as e:
            raise fail(str(e), e.exit_code) from None
        except KeyboardInterrupt:
            raise typer.Exit(130) from None

    return wrapper


PIPED_WIDTH = 200
"""Columns a table gets when stdout is not a terminal: Rich's default of 80 cut replica ids in
half, so a script piping ``ctl replicas`` could not pass one to ``ctl logs``."""


def console() -> Console:
    """The console tables print to: the terminal's width, or :data:`PIPED_WIDTH` when piped."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=PIPED_WIDTH)


def plain(text: str) -> str:
    """``text`` with every control character but newline and tab written out (``\\x1b``), for the
    terminal. What a node reports (an engine's version and detail, a GPU's name, a replica's error)
    reaches ``ctl`` from the admin API as the node wrote it; a compromised node's ``ESC ]0;…`` or
    ``ESC [2J`` would otherwise be run by the operator's terminal (retitle it, clear the screen,
    hide lines of the table)."""
    if text.isprintable():
        return text
    return "".join(
        ch if ch in "\n\t" or unicodedata.category(ch) != "Cc" else ascii(ch)[1:-1] for ch in text
    )


def table(*headers: str, **options: Any) -> Table:
    """A Rich table with these column ``headers`` (``options`` as ``rich.table.Table`` takes them).

    Its cells are shown as written: each string goes through :func:`plain` and becomes a Rich
    ``Text``, so neither a control character nor Rich markup (``[link=…]``) a node reported is
    acted on."""
    from rich.table import Table
    from rich.text import Text

    class _PlainTable(Table):
        def add_row(self, *renderables: Any, **kwargs: Any) -> None:
            super().add_row(*(Text(plain(r)) if isinstance(r, str) else r for r in renderables), **kwargs)

    return _PlainTable(*headers, **options)


def admin_client(server: str | None, token: str | None) -> AdminClient:
    """The admin API client of ``llmgw ctl``: ``server``/``token`` as given, else this machine's
    server.yaml and admin-token file (:meth:`~llmgw.adminclient.AdminClient.from_paths`)."""
    from llmgw.adminclient import AdminClient

    return AdminClient.from_paths(paths(), server=server, token=token)


def print_json(data: Any) -> None:
    """Print what the admin API answered, as it answered it (views are dumped as the server dumps them)."""
    from pydantic import BaseModel

    if isinstance(data, BaseModel):
        data = data.model_dump(mode="json")
    elif isinstance(data, list):
        data = [d.model_dump(mode="json") if isinstance(d, BaseModel) else d for d in data]
    print(json.dumps(data, indent=2, sort_keys=True))
