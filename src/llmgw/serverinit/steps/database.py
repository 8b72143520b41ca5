"""Step 1b (HA only): this machine's database member, PostgreSQL under Patroni, and server.yaml
pointing the control plane at the shared database.

On the first control plane (``--control-plane NAME=HOST[:PORT]``, repeatable, this machine
first) :func:`run`: the plan (:class:`~llmgw.serverinit.patroni.HaPlan`, kept in
``/etc/llmgw/ha.yaml``), Patroni's venv, the member's files (owned by ``postgres``), its unit, a wait
until Patroni reports this member the primary (``GET /primary`` 200), then the ``llmgw`` role and
database. On a standby (``--join DIR``, :mod:`llmgw.serverinit.standby` put the plan in place) the
same member setup waits until the member is a replica instead.

A Patroni that fails to start or to lead in ``patroni_wait_s`` stops init with Patroni's own last
log lines, and what this run made (the unit, the member's directory, ha.yaml) is removed, so
running init again starts clean. A second run keeps each piece (``kept …``), and accepts its member
as a streaming replica too (after a failover another member leads); it never stops a member that
was there before.
"""

from __future__ import annotations

import errno
import os
import pwd
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from llmgw.config import load_server_config
from llmgw.errors import ConfigError, LlmgwError, PortInUseError, ServiceError
from llmgw.paths import Paths
from llmgw.serverinit import files
from llmgw.serverinit.patroni import (
    DB_NAME,
    DB_OS_USER,
    DEFAULT_VENV,
    PG_BIN_DIR,
    HaPlan,
    Member,
    PatroniRest,
    create_database,
    ensure_venv,
    member_dirs,
    patroni_yml,
    patroni_yml_path,
    venv_ok,
)
from llmgw.serverinit.steps import services
from llmgw.serverinit.steps.context import InitContext
from llmgw.service.haunits import patroni_unit

SERVICE = "patroni"


def ha_yaml(paths: Paths) -> Path:
    """``/etc/llmgw/ha.yaml``: the HA plan (0600, root's: it holds the database passwords)."""
    return paths.etc / "ha.yaml"


def me_yaml(paths: Paths) -> Path:
    """``/etc/llmgw/ha-me``: which member of the plan this machine is (its name, one line)."""
    return paths.etc / "ha-me"


@dataclass
class Member1:
    """This machine in the plan: the plan and its own member."""

    plan: HaPlan
    me: Member


def local_dirs(ctx: InitContext, plan: HaPlan) -> HaPlan:
    """Where Patroni's venv, this member's files and PostgreSQL's binaries are on this machine:
    the flags, else the defaults under the install's root. Each machine's own choice, so a
    standby does not take the first control plane's from ha.yaml. Sets them on ``plan``, returns it."""
    opts, root = ctx.opts, ctx.paths.root
    plan.venv = opts.patroni_venv or (root / str(DEFAULT_VENV).lstrip("/"))
    plan.bin_dir = opts.pg_bin_dir or PG_BIN_DIR
    plan.dir = opts.patroni_dir or (root / "var/lib/llmgw-patroni")
    return plan


def plan_from_options(ctx: InitContext) -> HaPlan:
    """The plan the flags describe (new passwords), or the one in ha.yaml when it is there and the
    flags agree with it.

    Raises:
        ConfigError: a member spec does not parse, a name or address is used twice, or ha.yaml is
            there with other members or another DCS (the message says which, and how to start over).
    """
    opts = ctx.opts
    want = local_dirs(ctx, HaPlan(members=[Member.parse(s) for s in opts.control_planes], etcd=list(opts.etcd)))
    path = ha_yaml(ctx.paths)
    if not path.exists():
        return want
    have = HaPlan.load(path)
    diffs = have.same_cluster(want)
    if diffs:
        raise ConfigError(
            f"{path} already sets up another HA cluster: {'; '.join(diffs)}. Give init the same "
            f"--control-plane and --etcd flags, or remove {path} and {have.dir} to start over"
        )
    return local_dirs(ctx, have)


def check_machine(ctx: InitContext, plan: HaPlan) -> None:
    """What this machine needs for a database member, checked before anything is written.

    Raises:
        ConfigError: no PostgreSQL 15 in ``plan.bin_dir``, no ``postgres`` user, or ``--offline``
            with no Patroni venv (each says what to install or pass).
    """
    if not (plan.bin_dir / "postgres").exists():
        raise ConfigError(f"PostgreSQL 15 is not in {plan.bin_dir}: apt-get install postgresql-15, "
                          "or give --pg-bin-dir")
    try:
        pwd.getpwnam(DB_OS_USER)
    except KeyError as e:
        raise ConfigError(f"there is no user {DB_OS_USER}: apt-get install postgresql-15 makes it") from e
    if ctx.opts.offline and not venv_ok(plan.venv):
        raise ConfigError(f"--offline and no Patroni at {plan.venv}/bin/patroni: carry a venv in "
                          "(made with /usr/bin/python3) and give --patroni-venv")
    for path, flag in ((plan.dir, "--patroni-dir"), (plan.venv, "--patroni-venv"), (plan.bin_dir, "--pg-bin-dir")):
        closed = closed_parent(path)
        if closed is not None:
            raise ConfigError(
                f"the {DB_OS_USER} user cannot reach {path}: {closed} is not searchable by others "
                f"(mode {closed.stat().st_mode & 0o777:o}); Patroni and PostgreSQL run as {DB_OS_USER} "
                f"(docs/ha.md §1.5). Choose {flag} outside it, or chmod o+x {closed}"
            )


def closed_parent(path: Path) -> Path | None:
    """The first existing directory above ``path`` that others may not search (no ``o+x``),
    where a process of another user (``postgres``) cannot pass; None when there is none."""
    for parent in reversed(path.parents):
        if parent.exists() and not parent.stat().st_mode & 0o001:
            return parent
    return None


def run(ctx: InitContext, *, role: str = "primary") -> Member1:
    """This machine's database member, up as ``role`` (``primary`` on the first control plane,
    ``replica`` on a standby); the llmgw database on the primary. Returns the plan and member.

    Raises:
        ConfigError: bad flags (see :func:`plan_from_options`), or the PostgreSQL binaries are missing.
        ServiceError: Patroni's venv cannot be made, or Patroni failed (its last log lines).
        WaitTimeout: Patroni did not lead (or stream) in ``patroni_wait_s`` (its last log lines too).
    """
    paths = ctx.paths
    if role == "primary":
        plan = plan_from_options(ctx)
        me = plan.members[0]
    else:
        plan = HaPlan.load(ha_yaml(paths))
        me = plan.member(me_yaml(paths).read_text().strip())
        if plan.generated:
            raise ConfigError(no_raft_password(ha_yaml(paths)))
        # Where Patroni and its files are is this machine's choice, not the first control plane's.
        local_dirs(ctx, plan)
    check_machine(ctx, plan)
    fresh = not patroni_yml_path(plan).exists()
    if fresh:
        check_member_ports(plan, me)

    made: list[Path] = []  # what this run made, removed again when Patroni does not come up
    if venv_ok(plan.venv):
        ctx.say("kept", f"Patroni in {plan.venv}")
    else:
        ctx.progress(f"installing {plan.venv} (Patroni from PyPI, about 30 s)")
        ensure_venv(plan.venv, offline=ctx.opts.offline)
        ctx.say("done", f"Patroni in {plan.venv}")

    plan_path = ha_yaml(paths)
    if plan_path.exists() and plan.generated:
        backup = add_passwords(plan_path, plan)
        ctx.say("!!", f"{plan_path} had no password for Patroni's raft (written by an older init): made one and "
                      f"wrote it there (the old file is in {backup}), and {me.name}'s raft now binds "
                      f"{me.url_host}:{me.raft_port} only and needs it. Members with and without it cannot "
                      "talk: for each standby run 'llmgw server add-control-plane NAME --address ADDR --out "
                      "DIR' here and 'llmgw server init --join DIR' there, now (raft has no quorum until "
                      "most members have it)")
    elif plan_path.exists():
        ctx.say("kept", f"{plan_path}")
    else:
        paths.etc.mkdir(parents=True, exist_ok=True)
        files.write_atomic(plan_path, plan.to_yaml(), 0o600)
        files.write_atomic(me_yaml(paths), me.name + "\n", 0o600)
        made += [plan_path, me_yaml(paths)]
        ctx.say("done", f"{plan_path}: control planes {', '.join(m.spec for m in plan.members)}, "
                        f"DCS {'etcd ' + ', '.join(plan.etcd) if plan.etcd else 'raft'}")
    # A member that was there before may since have failed over: on the first control plane it
    # is then a replica, which is as good (and it must never be stopped for not leading).
    want = role if fresh else "member"
    try:
        new, kept = write_member(ctx, plan, me)
        made += new
        wait_member(ctx, plan, me, want, kept=kept)
        if role == "primary" and PatroniRest(me.rest_url).is_primary():
            for line in create_database(plan, me):
                tag, _, text = line.partition(" ")
                ctx.say(tag, text)
        elif role == "primary":
            ctx.say("kept", f"database {DB_NAME}: made when {me.name} led; another member leads now")
    except (LlmgwError, KeyboardInterrupt) as e:
        if not fresh or isinstance(e, KeyboardInterrupt):
            raise
        undo(ctx, made)
        raise type(e)(f"{e}\nnothing of the database member is left; fix the cause and run init again") from e
    return Member1(plan, me)


def no_raft_password(path: Path) -> str:
    """What to do about a standby's ha.yaml (or bundle) without raft's password: a password made
    here would not be the other members' (each would make its own), so the first control plane
    makes it and the bundle carries it."""
    return (f"{path} has no password for Patroni's raft (it was written by an older llmgw); run "
            "'llmgw server init' again on the first control plane with the same flags (it adds one), then "
            "write this standby's bundle again there ('llmgw server add-control-plane NAME --address ADDR "
            "--out DIR') and join with it")


def add_passwords(path: Path, plan: HaPlan) -> Path:
    """Write ``plan`` (with the passwords :meth:`HaPlan.from_doc` made) to ha.yaml, keeping the old
    file as ``ha.yaml.bak-YYYYmmdd-HHMMSS`` (0600 too); returns the backup's path."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    backup = path.with_name(f"{path.name}.bak-{stamp}")
    files.write_atomic(backup, path.read_text(), 0o600)
    files.write_atomic(path, plan.to_yaml(), 0o600)
    plan.generated = []
    return backup


def check_member_ports(plan: HaPlan, me: Member, *, joining: bool = False) -> None:
    """Before a new member is written: PostgreSQL's, Patroni's REST API's and (with raft) raft's
    ports must be free on its host. Another program there (another cluster's PostgreSQL or Patroni)
    would otherwise answer init's waits in this member's stead.

    Args:
        joining: a standby's ``--join``, whose ports the first control plane's
            ``--control-plane`` fixed in ha.yaml: the message says to free the port (``--join``
            takes no ``--control-plane``), not to choose another.

    Raises:
        PortInUseError: a port is taken (named, with the flag that sets it, or with what to stop on
            a standby), or cannot be listened on.
    """
    ports = [("PostgreSQL", me.pg_port), ("Patroni's REST API (PostgreSQL's + 2576)", me.rest_port)]
    if not plan.etcd:
        ports.append(("Patroni's raft (PostgreSQL's - 421)", me.raft_port))
    host = me.host.strip("[]")
    for what, port in ports:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as e:
                where = f"control plane {me.name}: {what} port {me.url_host}:{port}"
                if e.errno == errno.EADDRINUSE and joining:
                    why = (f"is already in use by another program (another PostgreSQL or Patroni?); "
                           f"'ss -ltnp sport = :{port}' names it. Stop it and run init --join again: the "
                           f"members' ports were fixed at the first control plane's init ({me.spec} in "
                           "the bundle's ha.yaml), so a standby cannot choose others")
                elif e.errno == errno.EADDRINUSE:
                    why = (f"is already in use by another program (another PostgreSQL or Patroni?); "
                           f"'ss -ltnp sport = :{port}' names it. Stop it, or give this member another "
                           f"PostgreSQL port: --control-plane {me.name}={me.url_host}:PORT")
                else:
                    why = f"cannot be listened on ({e.strerror}); is {me.url_host} an address of this machine?"
                raise PortInUseError(f"{where} {why}") from e


def write_member(ctx: InitContext, plan: HaPlan, me: Member) -> tuple[list[Path], bool]:
    """The member's directory (``postgres``'s, 0700), its ``patroni.yml`` (0600) and the unit, started.
    Returns what it made (for :func:`undo`), and whether Patroni was kept running as it was."""
    made: list[Path] = []
    if not plan.dir.exists():
        made.append(plan.dir)
    pw = pwd.getpwnam(DB_OS_USER)
    for d in [plan.dir, *member_dirs(plan).values()]:
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chown(d, pw.pw_uid, pw.pw_gid)
        d.chmod(0o700)
    cfg = patroni_yml_path(plan)
    body = patroni_yml(plan, me)
    changed = not cfg.exists() or cfg.read_text() != body
    if changed:
        files.write_atomic(cfg, body, 0o600)
        os.chown(cfg, pw.pw_uid, pw.pw_gid)
    ctx.say("done" if changed else "kept", f"{cfg} (member {me.name}, PostgreSQL on {me.url_host}:{me.pg_port}, "
                                            f"Patroni's REST API on {me.rest_port})")
    unit = ctx.paths.unit(SERVICE)
    if not unit.exists():
        made.append(unit)
    kept = services.apply_service(
        ctx, SERVICE, patroni_unit(ctx.paths, plan.venv, cfg), "database member (Patroni)",
        config_changed=cfg.name if changed and cfg not in made else "",
    )
    return made, kept


def wait_member(ctx: InitContext, plan: HaPlan, me: Member, role: str, *, kept: bool = False) -> None:
    """Wait until Patroni says ``me`` is ``role``: ``primary`` (``GET /primary`` answers 200),
    ``replica`` (``GET /patroni`` says a replica, streaming) or ``member`` (either). Says ``kept``
    when Patroni was ``kept`` running as it was.

    Raises:
        ServiceError: Patroni's process failed (with its last log lines).
        WaitTimeout: not ``role`` within ``patroni_wait_s`` (with Patroni's last log lines).
    """
    rest = PatroniRest(me.rest_url)

    def healthy() -> bool:
        return rest.is_primary() or rest.is_streaming()

    probe = {"primary": rest.is_primary, "replica": rest.is_streaming, "member": healthy}[role]

    def up() -> bool:
        ok = probe()
        if not ok:
            st = ctx.manager.status(SERVICE)
            if st.state == "failed":
                raise ServiceError(f"Patroni failed to start: {st.detail}\n{last_lines(ctx)}")
            ctx.note(f"Patroni says {rest.state()}")
        return ok

    try:
        ctx.wait(ctx.opts.patroni_wait_s, f"Patroni to make {me.name} the {role}", up, interval_s=0.5)
    except LlmgwError as e:
        if "Patroni failed" in str(e):
            raise
        raise type(e)(f"{e}\nPatroni's last lines:\n{last_lines(ctx)}") from e
    ctx.say("kept" if kept else "done", f"database member {me.name} is up ({rest.state()})" if role == "member"
            else f"database member {me.name} is the {role} ({rest.state()})")


def last_lines(ctx: InitContext, n: int = 15) -> str:
    """Patroni's (and PostgreSQL's) last ``n`` log lines, Python traceback frames left out: the
    line saying why is above a traceback that fills the tail otherwise."""
    kept = [ln for ln in ctx.manager.logs(SERVICE, 200).splitlines()
            if ln.strip() and not ln.startswith((" ", "\t", "Traceback"))]
    return "\n".join(kept[-n:])


def undo(ctx: InitContext, made: list[Path]) -> None:
    """Stop Patroni (and with it PostgreSQL) and remove what this run made."""
    try:
        ctx.manager.stop(SERVICE)
    except ServiceError as e:
        ctx.say("!!", f"stopping Patroni: {e}")
    for p in reversed(made):
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        ctx.say("..", f"removed {p}")


def server_yaml_block(plan: HaPlan, me: Member, agent_url: str) -> str:
    """The ``store:`` and ``cluster:`` blocks init appends to server.yaml on an HA control plane."""
    patroni = "".join(f"\n    - {u}" for u in plan.rest_urls())
    return (
        "\n# HA: the store on PostgreSQL kept by Patroni (every member; libpq picks the primary),\n"
        "# added by 'llmgw server init'. The password is in /etc/llmgw/ha.yaml too.\n"
        f"store:\n  url: \"{plan.store_url()}\"\n"
        f"cluster:\n  name: {me.name}\n  agent_url: {agent_url}\n  patroni:{patroni}\n"
    )


def check_new_member_ports(ctx: InitContext) -> None:
    """The first control plane's member, when this init makes it (no patroni.yml yet): its ports,
    checked with the other inputs before anything is written (:func:`check_member_ports`; they were
    checked only once the PKI and server.yaml were written, which a corrected rerun then kept).

    Raises:
        PortInUseError: as :func:`check_member_ports`.
    """
    plan = plan_from_options(ctx)
    if not patroni_yml_path(plan).exists():
        check_member_ports(plan, plan.members[0])


def check_not_sqlite(ctx: InitContext) -> None:
    """Refuse to make a single-machine install the first control plane of an HA cluster while its
    catalog, keys and usage are in SQLite: server.yaml names no ``store.url`` and the SQLite file
    exists. Init would write the PostgreSQL store into server.yaml and the control plane, once
    restarted, would start from an empty catalog (a new user's catalog was lost so, init saying
    ``done``).

    Raises:
        ConfigError: naming the file and the two ways on (start the cluster empty, or keep the
            single-machine install).
    """
    path, db = ctx.paths.server_config, ctx.paths.database
    if not path.exists() or not db.exists() or load_server_config(path).store.url:
        return
    raise ConfigError(
        f"this install keeps its catalog, API keys and usage in SQLite ({db}); an HA cluster keeps them in "
        "PostgreSQL, which this init would make empty, so they would be left behind. To start the cluster "
        f"empty: 'llmgw service stop --engines', move {db} (and its -wal/-shm files) aside, and run this init "
        "again; to keep them, keep this install as it is ('llmgw server migrate-store' copies a store into an "
        "empty database only, and the cluster's is not empty once init has made it)"
    )


def point_server_yaml(ctx: InitContext, plan: HaPlan, me: Member, agent_url: str) -> None:
    """Append the store and cluster blocks to server.yaml unless it has them (``kept``).

    Raises:
        ConfigError: server.yaml already names another store (a single-machine install on SQLite:
            copy it with ``llmgw server migrate-store`` first).
    """
    path = ctx.paths.server_config
    cfg = load_server_config(path)
    if cfg.store.url == plan.store_url() and cfg.cluster.name == me.name:
        ctx.say("kept", f"server.yaml's store (PostgreSQL on {len(plan.members)} members) and cluster {me.name}")
        return
    if cfg.store.url or cfg.cluster.name:
        raise ConfigError(
            f"{path} already has a store or cluster block for another setup; remove them "
            "(after 'llmgw server migrate-store --to' if it holds a catalog to keep) and run init again"
        )
    services.append_to_server_yaml(ctx, server_yaml_block(plan, me, agent_url))
    ctx.say("done", f"server.yaml: store on PostgreSQL ({len(plan.members)} members), cluster {me.name}")
