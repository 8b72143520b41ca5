"""What a node reports reaches an operator's terminal through ``llmgw ctl`` as text, never as
terminal commands or Rich markup: a compromised node's engine version, engine detail and GPU name
carrying ``ESC ]0;…BEL`` (retitle the terminal) or ``ESC [2J`` (clear it) are printed written out."""

from __future__ import annotations

from rich.console import Console

from llmgw.cli.common import plain, table
from llmgw.control.store import Store
from llmgw.protocol import GPU, EngineStatus, Heartbeat, Inventory, ProvisionState
from tests.helpers.control import ctl_on_admin_app

TOKEN = "t" * 32
LIE = "\x1b]0;PWNED\x07\x1b[2J[link=https://evil.example]x[/link]"


def _ctl_nodes(store: Store) -> str:
    """``llmgw ctl nodes`` against the real admin API on a loopback port (in a thread)."""
    return ctl_on_admin_app(store, "nodes", token=TOKEN)


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
