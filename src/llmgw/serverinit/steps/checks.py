"""Step 0: check the inputs before anything is written, so bad input leaves nothing half-written.

The starter and judge sources (a ``file:`` must be a GGUF file), ``--judge-format``,
``--llama-server`` (run with ``--version``), the starter's name and alias (valid, and not the
same), the listen ports (free unless this install's own service holds them), and an agent API
on loopback with nowhere for the node to reach it
(:mod:`llmgw.serverinit.preflight`).
"""

from __future__ import annotations

import dataclasses
import socket
from pathlib import Path

from llmgw import sourcecheck
from llmgw.config import ServerConfig, load_agent_config, load_server_config, parse_listen
from llmgw.errors import ConfigError, PortInUseError, SourceError
from llmgw.ggufheader import is_gguf
from llmgw.guard.formats import FORMATS
from llmgw.serverinit import preflight
from llmgw.serverinit.options import InitOptions
from llmgw.serverinit.steps.context import InitContext


def port_free(listen: str) -> bool:
    """True when ``listen`` (``HOST:PORT``) can be bound now."""
    host, port = parse_listen(listen)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def run(ctx: InitContext) -> None:
    """Check the inputs before anything is written.

    Raises:
        SourceError: the starter source is not a download, or its file is missing or not GGUF.
        ConfigError: the starter's name or alias is not valid, or the alias is the name;
            ``--llama-server`` is not a working llama-server (it is run with
            ``--version``); a config that exists does not load; the agent API listens on
            loopback while this node would be pointed at another address (pass ``--host``).
        PortInUseError: a listen port is taken by a program that is not this install's service.
    """
    opts, paths = ctx.opts, ctx.paths
    check_starter_source(opts.starter_source)
    preflight.check_starter_names(opts.starter_source, opts.starter_name, opts.starter_alias)
    check_judge_source(opts.judge_source, opts.judge_format, no_guard_model=opts.no_guard_model)
    ls = opts.llama_server
    if ls is not None:
        version = preflight.check_llama_server(ls)
        ctx.say("kept" if _agent_yaml_names(ctx, ls) else "done", f"--llama-server {ls} is llama.cpp build {version}")
    cfg = load_server_config(paths.server_config) if paths.server_config.exists() else None
    listeners = [("server", listen, flag) for flag, listen in _server_listens(ctx, cfg)]  # service, address, flag
    if not opts.mirror_url:
        listeners += [
            ("mirror", opts.mirror_listen, "--mirror-listen"),
            ("mirror", opts.mirror_api_listen, "--mirror-api-listen"),
        ]
    running = {s: ctx.running(s) for s in ("server", "mirror")}
    # every taken port at once: one at a time cost a second install up to five runs (a new user's finding)
    taken = [(parse_listen(listen)[1], flag) for service, listen, flag in listeners
             if not running[service] and not port_free(listen)]
    if len(taken) == 1:
        (port, flag), = taken
        raise PortInUseError(
            f"port {port} ({flag.lstrip('-')}) is already taken by another program; stop it, "
            f"or choose another address with {flag}"
        )
    if taken:
        ports = ", ".join(f"{port} ({flag.lstrip('-')})" for port, flag in taken)
        raise PortInUseError(
            f"ports {ports} are already taken by other programs; stop them, or choose other addresses with "
            + " ".join(f"{flag} HOST:PORT" for _port, flag in taken)
        )
    if not opts.no_node and not paths.agent_config.exists():
        preflight.check_agent_address(
            cfg.agent_listen if cfg else opts.agent_listen, opts.hosts, flag_given=cfg is None, ha=opts.ha
        )


def _server_listens(ctx: InitContext, cfg: ServerConfig | None) -> list[tuple[str, str]]:
    """``(flag, address)`` of the control plane's listeners: the flags', or server.yaml's when it
    exists. Then a ``!!`` line for each flag given with a value other than the file's: init writes
    server.yaml once and keeps it, so the flag changes nothing, and a silent keep read as if it had
    worked (a new user's report, 2026-12-04)."""
    defaults = {f.name: f.default for f in dataclasses.fields(InitOptions)}
    out = []
    for flag, in_file in (
        ("--admin-listen", cfg.admin_listen if cfg else None),
        ("--agent-listen", cfg.agent_listen if cfg else None),
        ("--gateway-listen", cfg.gateway.listen if cfg else None),
    ):
        attr = flag.removeprefix("--").replace("-", "_")
        given = getattr(ctx.opts, attr)
        if in_file is not None and given not in (defaults[attr], in_file):
            ctx.say("!!", f"{flag} {given} is not used: {ctx.paths.server_config} already says {in_file}, and "
                          "init keeps the file it wrote; change it there, then 'llmgw service restart server'")
        out.append((flag, in_file or given))
    return out


def _agent_yaml_names(ctx: InitContext, binary: Path) -> bool:
    """True when agent.yaml already names ``binary`` as its llama-server (it was so before this run)."""
    conf = ctx.paths.agent_config
    try:
        return conf.exists() and load_agent_config(conf).engines.llamacpp.binary == binary
    except ConfigError:
        return False


def check_judge_source(src: str, fmt: str, *, no_guard_model: bool) -> None:
    """``--judge-format`` must name a judge format, and a ``file:`` ``--judge-source`` a GGUF file.

    Raises:
        ConfigError: an unknown format. SourceError: the judge's file is not a GGUF file.
    """
    if fmt and fmt not in FORMATS:
        raise ConfigError(f"--judge-format {fmt}: not a judge format; use one of {', '.join(FORMATS)}")
    if not src or no_guard_model:
        return
    d = sourcecheck.to_download(src)
    if d.kind == "file":
        path = Path(d.path or "")
        if not path.is_file() or not is_gguf(path):
            raise SourceError(
                f"--judge-source {src}: {path} is not a GGUF file; give the path of the judge's .gguf"
            )


def check_starter_source(src: str) -> None:
    """A ``file:`` ``--starter-source`` must exist and start with the bytes ``GGUF``.

    Raises:
        SourceError: the file is missing or not GGUF (the message says what to give instead).
    """
    d = sourcecheck.to_download(src)
    if d.kind == "file":
        path = Path(d.path or "")
        if not path.is_file():
            raise SourceError(
                f"--starter-source {src}: {path} does not exist; give the path of a GGUF file "
                "(scripts/assets assembles one)"
            )
        if not is_gguf(path):
            raise SourceError(
                f"--starter-source {src}: {path} is not a GGUF file (it does not start with the "
                "bytes 'GGUF'); give a .gguf model file"
            )
