"""The unit of an HA control plane's database member: PostgreSQL under Patroni.

One text serves systemd and llmgw's supervisor (:mod:`llmgw.service.units`), which applies
``User=``/``Group=`` as systemd does. Patroni runs as ``postgres`` (PostgreSQL refuses root) from
its own venv (docs/ha.md §1.5), and on SIGTERM stops PostgreSQL before it exits, hence
``KillMode=mixed`` (SIGTERM to Patroni alone, SIGKILL to what is left after the timeout) and a
60 s ``TimeoutStopSec`` for a checkpoint.
"""

from __future__ import annotations

from pathlib import Path

from llmgw.paths import Paths
from llmgw.service.units import _escape, _exec, _root_env


def patroni_unit(paths: Paths, venv: Path, config: Path, *, user: str = "postgres") -> str:
    """Patroni's unit: ``<venv>/bin/patroni <config>`` as ``user``.

    ``Restart=on-failure`` after 2 s: a Patroni that died leaves PostgreSQL running unmanaged (the
    orphan of docs/ha.md §1.4, run s2/s5); restarting it demotes or re-adopts PostgreSQL within 2-5 s.
    """
    return (
        "[Unit]\n"
        "Description=llmgw database member: PostgreSQL under Patroni\n"
        "After=network-online.target\n"
        "Wants=network-online.target\n"
        "[Service]\n"
        f"ExecStart={_exec([str(venv / 'bin' / 'patroni'), str(config)])}\n"
        f"{_root_env(paths)}"
        "# PostgreSQL refuses to run as root; Patroni runs it, so both run as postgres.\n"
        f"User={user}\n"
        f"Group={user}\n"
        "# A Patroni that died leaves PostgreSQL running on its own, perhaps as a\n"
        "# primary nobody fences: bring it back soon, and it demotes or adopts it.\n"
        "Restart=on-failure\n"
        "RestartSec=2s\n"
        "# SIGTERM to Patroni only: it stops PostgreSQL itself, with a checkpoint.\n"
        "KillMode=mixed\n"
        "TimeoutStopSec=60s\n"
        f"WorkingDirectory={_escape(str(config.parent), dollar=False)}\n"
        "[Install]\n"
        "WantedBy=multi-user.target\n"
    )
