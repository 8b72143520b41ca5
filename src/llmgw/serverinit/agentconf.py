"""agent.yaml's llama-server: what init wrote there, and when a later init may change it.

init writes agent.yaml once. Its ``engines.llamacpp.binary`` is the one value a later init may
change, and only when init itself put that value there: the operator passed ``--llama-server``
again with another path to correct it. A value the operator edited by hand is never overwritten.

How init tells the two apart: each time it writes the value it records it in
``<state>/init-written.json`` (``{"agent.yaml": {"engines.llamacpp.binary": "/path" | null}}``).
When agent.yaml's value is still the recorded one, nobody has edited it since, and init may
replace it; otherwise (edited, or an agent.yaml from before the record existed) it only warns.
An update rewrites the one ``binary:`` line (or appends an ``engines:`` block when init wrote
none), keeps the file as it was in ``agent.yaml.bak``, checks the result loads with the new
value, and records it.

Its control planes are the other value a later init changes: on an HA control
plane agent.yaml names every control plane, ``server`` this one and ``servers`` the others from
``/etc/llmgw/ha.yaml``, as a node that ``server add-node`` made does; one naming only the first
lost its control plane whenever that one was down when the agent (re)started. A rerun adds the
missing ones to ``servers`` (:func:`add_servers`), keeping the old file beside it
(``agent.yaml.bak-YYYYmmdd-HHMMSS``); URLs already there (or added by hand) stay, in their order.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

from llmgw.atomicfile import write_atomic
from llmgw.config import load_agent_config
from llmgw.errors import ConfigError

_SERVERS_KEY = re.compile(r"(?m)^servers[ \t]*:.*$")
"""agent.yaml's top-level ``servers:`` line (its block is the indented, blank or comment lines below)."""

KEY = "engines.llamacpp.binary"
RECORD_NAME = "init-written.json"


@dataclass(frozen=True)
class Outcome:
    """What :func:`reconcile_binary` did: ``action`` is ``kept`` (already so), ``updated``
    (``old`` replaced, ``backup`` written) or ``hand_edited`` (left alone: ``old`` is not what
    init wrote, ``recorded`` is what it did write; ``known`` False when it has no record)."""

    action: str
    old: Path | None
    backup: Path | None = None
    recorded: str | None = None
    known: bool = False  # init has a record of what it wrote


def _record_path(state: Path) -> Path:
    return state / RECORD_NAME


def _read_record(state: Path) -> dict[str, dict[str, str | None]]:
    try:
        data = json.loads(_record_path(state).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def record_binary(state: Path, binary: Path | None) -> None:
    """Note that init wrote ``binary`` (None: no ``engines`` block) as agent.yaml's llama-server."""
    data = _read_record(state)
    data.setdefault("agent.yaml", {})[KEY] = str(binary) if binary is not None else None
    state.mkdir(parents=True, exist_ok=True)
    write_atomic(_record_path(state), json.dumps(data, indent=2, sort_keys=True) + "\n", 0o600)


def _recorded(state: Path) -> tuple[bool, str | None]:
    """``(known, value)``: whether init recorded agent.yaml's binary, and the value it wrote."""
    section = _read_record(state).get("agent.yaml", {})
    if not isinstance(section, dict) or KEY not in section:
        return False, None
    return True, section[KEY]


def _replace(text: str, have: Path | None, new: Path) -> str | None:
    """agent.yaml's text with the binary changed to ``new``, or None when the line is not found
    where init writes it (then the file is not init's shape any more)."""
    if have is None:
        if re.search(r"(?m)^engines\s*:", text):
            return None
        sep = "" if text.endswith("\n") or not text else "\n"
        return f"{text}{sep}engines:\n  llamacpp:\n    binary: {new}\n"
    line = re.compile(rf"(?m)^([ \t]+binary:[ \t]*)([\"']?){re.escape(str(have))}\2[ \t]*$")
    if len(line.findall(text)) != 1:
        return None
    return line.sub(lambda m: f"{m.group(1)}{new}", text)


def reconcile_binary(conf: Path, state: Path, new: Path) -> Outcome:
    """Make agent.yaml's ``engines.llamacpp.binary`` ``new`` when init wrote the value there.

    Args:
        conf: agent.yaml (it exists).
        state: init's state directory (where the record lives).
        new: the ``--llama-server`` given now (absolute, already checked to be a llama-server).

    Returns:
        An :class:`Outcome`; the file changes only when its action is ``updated``.

    Raises:
        ConfigError: agent.yaml does not load (named), or the rewritten file does not load with
            the new value (agent.yaml is then restored from the backup).
    """
    have = load_agent_config(conf).engines.llamacpp.binary
    if have == new:
        return Outcome("kept", have)
    known, recorded = _recorded(state)
    ours = known and recorded == (str(have) if have is not None else None)
    text = conf.read_text()
    updated = _replace(text, have, new) if ours else None
    if updated is None:
        return Outcome("hand_edited", have, recorded=recorded, known=known)
    backup = conf.with_name(conf.name + ".bak")
    mode = conf.stat().st_mode & 0o777
    write_atomic(backup, text, mode)
    write_atomic(conf, updated, mode)
    try:
        now = load_agent_config(conf).engines.llamacpp.binary
    except ConfigError:
        now = None
    if now != new:
        write_atomic(conf, text, mode)
        raise ConfigError(
            f"{conf}: changing engines.llamacpp.binary to {new} did not give a file that says so; "
            f"it is left as it was (a copy is in {backup}); edit it by hand"
        )
    record_binary(state, new)
    return Outcome("updated", have, backup=backup, recorded=recorded, known=True)


@dataclass(frozen=True)
class ServersOutcome:
    """What :func:`add_servers` did: ``added`` the URLs it put into ``servers`` (empty: the file
    was left as it was) and ``backup`` the copy of the old file (None when nothing changed)."""

    added: list[str]
    backup: Path | None = None


def _servers_block(urls: list[str]) -> str:
    return "servers:\n" + "".join(f'  - "{u}"\n' for u in urls)


def _with_servers(text: str, urls: list[str]) -> str:
    """agent.yaml's text with its top-level ``servers`` replaced by ``urls`` (added at the end
    when it has none); the rest of the file, comments included, is kept as it was."""
    m = _SERVERS_KEY.search(text)
    if m is None:
        sep = "" if text.endswith("\n") or not text else "\n"
        head = "# Every control plane of the HA cluster, added by 'llmgw server init'.\n"
        return f"{text}{sep}{head}{_servers_block(urls)}"
    end = m.end() + 1
    lines = text[end:].splitlines(keepends=True)
    taken = 0
    for line in lines:
        if line.strip() and not line.startswith((" ", "\t", "-")):
            break
        taken += len(line)
    # Trailing blank and comment lines belong to what follows, not to the block.
    block = text[end:end + taken]
    kept_tail = ""
    for line in reversed(block.splitlines(keepends=True)):
        if line.strip() and not line.lstrip().startswith("#"):
            break
        kept_tail = line + kept_tail
    return text[:m.start()] + _servers_block(urls) + kept_tail + text[end + taken:]


def add_servers(conf: Path, want: list[str], *, now: float | None = None) -> ServersOutcome:
    """Make agent.yaml name every control plane in ``want``: the ones it names neither as
    ``server`` nor in ``servers`` are appended to ``servers``.

    Args:
        conf: agent.yaml (it exists).
        want: every control plane's agent API URL (``https://HOST:PORT``), this one first.
        now: the backup's timestamp (seconds since the epoch; default now).

    Returns:
        A :class:`ServersOutcome`; the file changes only when ``added`` is not empty.

    Raises:
        ConfigError: agent.yaml does not load (the file is left as it is; the message names it
            and says to fix or remove it), or the rewritten file does not name them all (it is
            restored, the copy named).
    """
    try:
        cfg = load_agent_config(conf)
    except ConfigError as e:
        raise ConfigError(
            f"{e}\n{conf} is left as it is, so init cannot add the other control planes to it: fix it "
            f"(or remove it for init to write a new one) and run init again"
        ) from e
    have = cfg.control_planes
    missing = [u for u in dict.fromkeys(want) if u not in have]
    if not missing:
        return ServersOutcome([])
    text = conf.read_text()
    urls = [*cfg.servers, *missing]
    updated = _with_servers(text, urls)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    backup = conf.with_name(f"{conf.name}.bak-{stamp}")
    mode = conf.stat().st_mode & 0o777
    write_atomic(backup, text, mode)
    write_atomic(conf, updated, mode)
    try:
        ok = set(want) <= set(load_agent_config(conf).control_planes)
    except ConfigError:
        ok = False
    if not ok:
        write_atomic(conf, text, mode)
        raise ConfigError(
            f"{conf}: adding the control planes {', '.join(missing)} to 'servers' did not give a file that "
            f"names them; it is left as it was (a copy is in {backup}); add them by hand"
        )
    return ServersOutcome(missing, backup)
