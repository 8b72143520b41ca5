"""Checks ``server init`` makes before it writes anything, beyond "the file is there".

* :func:`check_llama_server`: ``--llama-server`` must *be* a llama-server. An executable that is
  not one (a script, the wrong binary, one missing its shared libraries) used to pass; init then
  wrote agent.yaml naming it, started the agent, and failed minutes later, with agent.yaml never
  rewritten. Now it is run (``--version``, with a timeout) and its answer must look like
  llama.cpp's: a line ``version: <build> (<commit>)``.
* :func:`check_agent_address`: an agent API on loopback only is reachable only at a loopback
  address; the node on this machine is pointed at the first ``--host`` (else this machine's first
  address), so a loopback ``--agent-listen`` without a loopback ``--host`` points the agent where
  nothing listens, and init waited for it in silence.
* :func:`check_starter_names`: the starter's catalog name and ``--starter-alias`` must be valid
  names and differ. An alias equal to the name passed every earlier check and reached the
  catalog entry at step 6, after the control plane, the mirror and the node were set up, and init
  ended in a pydantic traceback.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import signal
import socket
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

from llmgw.config import parse_listen
from llmgw.errors import ConfigError
from llmgw.names import check_name
from llmgw.serverinit import plan

VERSION_TIMEOUT_S = 10.0
"""``llama-server --version`` answers in milliseconds (0.04 s for the assets' build here; a CUDA
build probes its devices first, a second or two); a binary that hangs there is refused rather than
waited on, and init is never silent for longer than this."""

_LLAMA_VERSION = re.compile(r"(?m)^version: (\S+) \(([^)]*)\)")
"""llama.cpp's ``--version`` line, e.g. ``version: 5318 (a1b2c3d4)`` (printed on stderr)."""

Runner = Callable[[Sequence[str]], "subprocess.CompletedProcess[str]"]
"""Runs an argv with a timeout and returns its completed process; raises OSError or SubprocessError."""


def run_version(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    """The real runner: text output, :data:`VERSION_TIMEOUT_S`, never raises for a non-zero exit.

    The binary runs in its own process group, and the whole group is killed when it is done or
    hangs: a wrapper script's children (``sleep 1000 &``) would otherwise outlive the probe.
    """
    with subprocess.Popen(
        list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
        start_new_session=True,
    ) as proc:
        try:
            out, err = proc.communicate(timeout=VERSION_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.communicate(timeout=2)
            raise
        finally:
            _kill_group(proc.pid)
    return subprocess.CompletedProcess(list(argv), proc.returncode, out, err)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def check_llama_server(path: Path, *, runner: Runner = run_version) -> str:
    """Run ``path --version`` and return the llama.cpp build it prints (``"5318"``).

    Raises:
        ConfigError: ``path`` is not an executable file, does not run, hangs past
            :data:`VERSION_TIMEOUT_S`, exits non-zero, or prints no ``version: <build> (<commit>)``
            line; the message quotes what it printed and says what to pass instead.
    """
    fix = "give the path of a llama-server binary (scripts/assets builds one)"
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise ConfigError(f"--llama-server {path} is not an executable file; {fix}")
    try:
        done = runner([str(path), "--version"])
    except subprocess.TimeoutExpired as e:
        raise ConfigError(
            f"--llama-server {path}: '{path.name} --version' did not answer within {VERSION_TIMEOUT_S:.0f} s, "
            f"so it is not a working llama-server; {fix}"
        ) from e
    except (OSError, subprocess.SubprocessError) as e:
        raise ConfigError(f"--llama-server {path} does not run: {e}; {fix}") from e
    out = f"{done.stdout}\n{done.stderr}"
    m = _LLAMA_VERSION.search(out)
    if done.returncode == 0 and m:
        return m.group(1)
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    said = f"printed '{lines[-1][:200]}'" if lines else "printed nothing"
    raise ConfigError(
        f"--llama-server {path} is not a working llama-server: '{path.name} --version' exited "
        f"{done.returncode} and {said}, not llama.cpp's 'version: <build> (<commit>)'; {fix}"
    )


def is_loopback(host: str) -> bool:
    """True for ``localhost``, a loopback address, or a name that resolves to loopback addresses only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    addrs = {str(info[4][0]) for info in infos}
    return bool(addrs) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)


def _addresses(host: str) -> set[str]:
    """The IP addresses ``host`` (a name or an address, IPv6 maybe in brackets) stands for; empty when it
    does not resolve."""
    bare = host.strip("[]")
    try:
        return {str(ipaddress.ip_address(bare))}
    except ValueError:
        pass
    try:
        return {str(info[4][0]).split("%")[0] for info in socket.getaddrinfo(bare, None)}
    except OSError:
        return set()


def url_host(host: str) -> str:
    """``host`` as it goes before ``:PORT``: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def check_agent_address(
    agent_listen: str, hosts: Sequence[str], *, flag_given: bool = True, ha: bool = False
) -> None:
    """Refuse an agent API on loopback when this machine's agent would be pointed elsewhere.

    Args:
        agent_listen: the agent API's ``HOST:PORT`` (``--agent-listen`` or server.yaml's).
        hosts: ``--host`` values; the first is the address the node is given.
        flag_given: False when ``agent_listen`` comes from an existing server.yaml (named so).
        ha: an HA init, whose first host is this control plane's ``--control-plane`` address (named
            so: a new user was told of a "first --host" they never gave).

    Raises:
        ConfigError: the listen address is loopback and there is no ``--host``, or the first
            ``--host`` is not a loopback name, or is a loopback address the listener does not
            accept (``--host 127.0.0.2`` with ``--agent-listen 127.0.0.1:PORT``).
    """
    host, port = parse_listen(agent_listen)
    if host in ("", "0.0.0.0", "::") or not is_loopback(host):
        return
    first = f"this control plane's --control-plane address, {hosts[0]}," if ha and hosts else (
        f"the first --host, {hosts[0]}," if hosts else "")
    source = f"--agent-listen {agent_listen}" if flag_given else f"agent_listen {agent_listen} (server.yaml)"
    if hosts and is_loopback(hosts[0]):
        if _addresses(hosts[0]) & _addresses(host):
            return
        raise ConfigError(
            f"{source} accepts agents at {host} only, but this machine's node would be pointed at {first} a "
            "loopback address the agent API does not listen on, so nothing would answer it; "
            f"{'give this control plane ' + host + ' in --control-plane' if ha else 'pass --host ' + host + ' first'}"
            f", or make --agent-listen {url_host(hosts[0])}:{port}"
        )
    where = first or "this machine's network address (no --host was given)"
    raise ConfigError(
        f"{source} accepts agents on loopback only, but this machine's node would be pointed at {where} "
        f"on port {port}, where nothing listens; pass --host {host} for a one-machine cluster, or listen "
        f"on every address (--agent-listen :{port}) so other machines' nodes can join too"
    )


def check_starter_names(source: str, name: str, alias: str) -> plan.StarterSpec:
    """The starter's catalog name and alias, checked as the catalog will check them; returns the spec.

    Args:
        source: ``--starter-source`` (the name is derived from its file when ``name`` is empty).
        name: ``--starter-name`` (``""``: derived).
        alias: ``--starter-alias`` (``""``: the default starter's alias, or none for another file).

    Raises:
        ConfigError: the name or the alias is not a valid name (:mod:`llmgw.names`), or the alias
            is the name itself (a model cannot be its own alias); the message names the flags.
    """
    spec = plan.starter_spec(source, name=name, alias=alias)
    given = "--starter-name" if name else f"the name derived from --starter-source ({spec.name!r})"
    try:
        check_name(spec.name, "model name")
    except ValueError as e:
        raise ConfigError(f"{given}: {e}; pass --starter-name NAME") from e
    if not spec.alias:
        return spec
    try:
        check_name(spec.alias, "alias")
    except ValueError as e:
        raise ConfigError(f"--starter-alias: {e}") from e
    if spec.alias == spec.name:
        raise ConfigError(
            f"--starter-alias {spec.alias} is the starter's own name ({given}); a model cannot be its own "
            "alias: leave --starter-alias out, or give another one (clients may ask for either)"
        )
    return spec
