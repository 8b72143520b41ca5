"""Files ``server init`` writes: server.yaml (written once, then only appended to with a backup),
agent.yaml (written once, see agentconf), tokens and keys (0600). Every write is atomic (temp name, fsync,
rename), so a crash mid-write leaves the old file or the new one, never half of either.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path

import yaml

from llmgw import yamlsafe
from llmgw.atomicfile import write_atomic
from llmgw.errors import ConfigError

__all__ = [
    "agent_yaml", "append_block", "guard_block", "mirror_block", "new_secret", "server_yaml", "write_atomic",
]


def new_secret(prefix: str = "") -> str:
    """A random token (``secrets.token_urlsafe(32)``, 256 bits) with an optional prefix."""
    return prefix + secrets.token_urlsafe(32)


def append_block(path: Path, block: str, *, now: float | None = None) -> Path:
    """Append ``block`` to ``path`` without touching the rest, keeping the file as it was beside it.

    The backup is ``<path>.bak-YYYYmmdd-HHMMSS``; the file keeps its mode.
    Returns the backup's path.

    Raises:
        ConfigError: the file already has a top-level key the block sets (an empty ``guard:`` or
            ``mirror:``): two would make the file unreadable (:mod:`llmgw.yamlsafe`), so nothing
            is written.
    """
    old = path.read_text()
    try:
        yamlsafe.load(old + "\n" + block)
    except yamlsafe.DuplicateKeyError as e:
        raise ConfigError(
            f"{path}: cannot add a block: {e.problem}; fill in or remove the existing one, then run init again"
        ) from e
    except yaml.YAMLError:
        pass  # the file was not valid YAML before either; loading it reports that
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    backup = path.with_name(f"{path.name}.bak-{stamp}")
    mode = path.stat().st_mode & 0o777
    write_atomic(backup, old, 0o640)
    sep = "" if old.endswith("\n") or not old else "\n"
    write_atomic(path, old + sep + block, mode)
    return backup


def mirror_block(api: str, comment: str) -> str:
    """The ``mirror:`` block init appends to server.yaml, after its comment lines."""
    return f"\n{comment}\nmirror:\n  api: {api}\n"


def guard_block(judge: str) -> str:
    """The default guard policy init appends to server.yaml: ``judge`` reads every prompt and answer,
    and a request nothing judged is refused (``fail: closed``)."""
    return f"""
# Guardrails, added by 'llmgw server init': every prompt (in) and answer (out) is judged by
# {judge}; Unsafe is refused, Controversial served with a warning in the log, and with no
# verdict (judge down or over its budget) the request is refused (fail: closed).
guard:
  policies:
    - name: default
      judge: [{judge}]
      check: [in, out]
      controversial: warn
      fail: closed
      budget_s: 5
"""


def server_yaml(
    *, admin_listen: str, agent_listen: str, gateway_listen: str, pki: Path, keys_file: Path,
) -> str:
    """The server.yaml init writes on a new machine (a mirror block is appended by a later step)."""
    return f"""# The llmgw control plane, written by 'llmgw server init'. init never rewrites this file: it
# only appends blocks, keeping a timestamped backup beside it. Edit it freely.
admin_listen: "{admin_listen}"
agent_listen: "{agent_listen}"
tls:
  ca: {pki / "ca.pem"}
  cert: {pki / "server.pem"}
  key: {pki / "server-key.pem"}
gateway:
  listen: "{gateway_listen}"
  keys_file: {keys_file}
  # A single-machine install: clients on this machine may ask without a key; every other client
  # needs one of the keys in keys_file. Set this to false to require a key from everyone.
  allow_loopback_without_key: true
"""


def _advertise_comment(advertise: str) -> str:
    if advertise == "127.0.0.1":
        return "# Engines bind loopback: on one machine only the gateway beside them calls them."
    return "# Engines bind this address: every control plane's gateway calls them here (HA)."


def agent_yaml(
    *, server: str, node_id: str, etc: Path, label_key: str, label_value: str, llama_server: Path | None,
    servers: list[str] | None = None, advertise: str = "127.0.0.1",
) -> str:
    """This machine's agent.yaml as the node of its own control plane (plus the engine when one is
    given). ``servers``: the other control planes' agent API URLs on an HA cluster (the agent
    tries ``server`` first, then these). ``advertise``: where its engines bind and gateways dial
    them: loopback on one machine; on an HA cluster this machine's address, which the other control
    planes' gateways reach (:func:`llmgw.serverinit.steps.node.own_advertise`)."""
    others = ""
    if servers:
        others = "# The other control planes of the HA cluster: the agent turns to them when this one is down.\n"
        others += "servers:\n" + "".join(f'  - "{u}"\n' for u in servers)
    engine = ""
    if llama_server is not None:
        engine = f"engines:\n  llamacpp:\n    binary: {llama_server}\n"
    return f"""# This machine as a node of its own control plane, written by 'llmgw server init'.
server: "{server}"
{others}node_id: "{node_id}"
tls:
  ca: {etc / "ca.pem"}
  cert: {etc / "agent.pem"}
  key: {etc / "agent-key.pem"}
labels:
  {label_key}: "{label_value}"
{_advertise_comment(advertise)}
advertise_address: "{advertise}"
{engine}"""
