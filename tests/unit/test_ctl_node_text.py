"""What a node reports reaches an operator's terminal through ``llmgw ctl`` as text, never as
terminal commands or Rich markup: a compromised node's engine version, engine detail and GPU name
carrying ``ESC ]0;…BEL`` (retitle the terminal) or ``ESC [2J`` (clear it) are printed written out."""

from __future__ import annotations

import asyncio
import threading

from aiohttp import web
from rich.console import Console
from typer.testing import CliRunner

from llmgw.cli.common import plain, table
from llmgw.cli.main import app as cli
from llmgw.control.api.admin import build_admin_app
from llmgw.control.store import Store
from llmgw.protocol import GPU, EngineStatus, Heartbeat, Inventory, ProvisionState

TOKEN = "t" * 32
LIE = "\x1b]0;PWNED\x07\x1b[2J[link=https://evil.example]x[/link]"


def _ctl_nodes(store: Store) -> str:
    """``llmgw ctl nodes`` against the real admin API on a loopback port (in a thread)."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(build_admin_app(store, token=TOKEN, on_change=lambda: None, clock=lambda: 1000.0))
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        r = CliRunner().invoke(cli, ["ctl", "nodes", "--server", f"http://127.0.0.1:{port}", "--token", TOKEN])
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.run_until_complete(runner.cleanup())
        loop.close()
    assert r.exit_code == 0, r.output
    return r.output


def test_ctl_nodes_prints_a_nodes_control_characters_written_out(store: Store) -> None:
    gpu = GPU(index=0, name="card" + LIE, klass="h100-80gb", memory_total_bytes=0)
    inv = Inventory(hostname="h", cores=4, memory_total_bytes=2**33, memory_available_bytes=2**33, gpus=[gpu])
    engine = EngineStatus(engine="llamacpp", version="1" + LIE, state=ProvisionState.FAILED, detail="d" + LIE)
    store.upsert_node_heartbeat("evil", Heartbeat(inventory=inv, engines=[engine]), 999.0)
    out = _ctl_nodes(store)
    assert "\x1b" not in out
    assert "\x07" not in out
    assert "evil: llamacpp: d\\x1b]0;PWNED\\x07\\x1b[2J" in out  # the detail line, written out
    assert "card\\x1b]0;PWNED" in out  # the GPU's problem line


def test_table_cells_are_text_not_markup() -> None:
    t = table("A")
    t.add_row("x" + LIE)
    console = Console(width=300, force_terminal=True)
    with console.capture() as cap:
        console.print(t)
    shown = cap.get()
    assert "PWNED" in shown
    assert "\x07" not in shown
    assert "\x1b]" not in shown  # Rich's own styling is ESC [, an OSC (title, hyperlink) ESC ]
    assert "[link=https://evil.example]x[/link]" in shown  # the markup as written, not a link
    assert plain("a\nb\tc") == "a\nb\tc"
