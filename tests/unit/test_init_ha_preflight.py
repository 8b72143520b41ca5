"""HA ``server init``'s checks that must come before anything is written (a new user's findings):
a single-machine install whose catalog is in SQLite is refused (init said ``done`` and the control
plane, restarted, had lost the catalog), and a new member's taken PostgreSQL port is refused before
the PKI and server.yaml are written (a corrected rerun then kept them, and their typo). The real CLI."""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import tempfile
from pathlib import Path

from tests.conftest import skip_or_fail
from tests.helpers.control import make_install
from tests.helpers.hacluster import DEFAULT_PATRONI
from tests.helpers.init import init_cli, written
from tests.helpers.net import free_port


def test_ha_init_over_a_single_machine_install_on_sqlite_is_refused_and_nothing_changes(tmp_path: Path) -> None:
    inst = make_install(tmp_path / "root")
    inst.paths.database.parent.mkdir(parents=True, exist_ok=True)
    inst.paths.database.write_bytes(b"SQLite format 3\x00")  # the catalog of the install
    before = {f: (inst.root / f).read_bytes() for f in written(inst.root)}
    code, out = init_cli(inst.root, "--control-plane", "cp1=127.0.0.1:25432", "--control-plane", "cp2=127.0.0.2:25432")
    assert code == 2, out
    assert f"this install keeps its catalog, API keys and usage in SQLite ({inst.paths.database})" in out
    assert "To start the cluster empty: 'llmgw service stop --engines', move" in out
    assert {f: (inst.root / f).read_bytes() for f in written(inst.root)} == before


def _pg_port() -> int:
    """A free port whose Patroni REST (+2576) and raft (-421) ports are valid too."""
    while True:
        port = free_port()
        if 1024 + 421 <= port <= 65535 - 2576:
            return port


def test_a_new_member_s_taken_postgresql_port_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    if not Path("/usr/lib/postgresql/15/bin/postgres").exists():
        skip_or_fail("needs the PostgreSQL 15 binaries (/usr/lib/postgresql/15/bin) to get past their check")
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        skip_or_fail("needs the postgres user (the postgresql-15 package makes it) to get past the machine's check")
    patroni = Path(os.environ.get("PATRONI") or DEFAULT_PATRONI)
    if not patroni.exists():
        skip_or_fail(f"needs Patroni's venv ({patroni}; scripts/assets makes it) to get past its check")
    model = os.environ.get("MODEL", "")
    if not model:
        skip_or_fail("needs MODEL (a GGUF file; scripts/assets sets it) as the starter source")
    root = tmp_path / "root"
    pg = _pg_port()
    # Patroni's directory must be reachable by the postgres user (pytest's tmp is mode 700): checked first.
    patroni_dir = Path(tempfile.mkdtemp(prefix="llmgw-preflight-", dir="/tmp"))
    patroni_dir.chmod(0o755)
    try:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", pg))
            taken.listen()
            code, out = init_cli(
                root, "--control-plane", f"cp1=127.0.0.1:{pg}", "--control-plane", f"cp2=127.0.0.2:{pg}",
                "--patroni-venv", str(patroni.parent.parent), "--patroni-dir", str(patroni_dir / "p"),
                "--starter-source", f"file:{model}", "--no-node", "--no-guard-model",
            )
    finally:
        shutil.rmtree(patroni_dir)
    assert code != 0, out
    assert f"PostgreSQL port 127.0.0.1:{pg} is already in use" in out, out
    assert written(root) == []  # no CA, certificate, token or server.yaml before it
