"""What llmgw's supervisor reads from a systemd unit file, and the credentials it runs the program
with: ``ExecStart=`` (systemd's quoting and escapes undone), ``Restart=``/``RestartSec=``,
``TimeoutStopSec=``, ``Environment=``, ``User=``/``Group=``/``SupplementaryGroups=``/``UMask=``,
``StartLimitBurst=``/``StartLimitIntervalSec=``. Everything else in a unit (the sandboxing lines) is
systemd's alone and ignored here: the supervisor applies the user switch the way systemd would
(:func:`credentials`) and says so, it does not emulate the sandbox.

Used by :mod:`llmgw.service.supervisor` (which runs the program) and by :mod:`llmgw.service.check`
and :mod:`llmgw.service.manager` (which read a unit without running it).
"""

from __future__ import annotations

import grp
import os
import pwd
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field

from llmgw.errors import ServiceError

STOP_TIMEOUT = 15.0
"""Seconds the program has to end after SIGTERM before SIGKILL (systemd's default is 90)."""

SYSTEMD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
"""The ``PATH`` systemd gives a system service (its ``DEFAULT_PATH``; ``/sbin:/bin`` are the
split-usr tail, the same directories on a merged-usr system)."""

LOCALE_VARS = ("LANG", "LANGUAGE", "LC_CTYPE", "LC_NUMERIC", "LC_TIME", "LC_COLLATE", "LC_MONETARY",
               "LC_MESSAGES", "LC_PAPER", "LC_NAME", "LC_ADDRESS", "LC_TELEPHONE", "LC_MEASUREMENT",
               "LC_IDENTIFICATION", "LC_ALL")
"""The locale settings systemd passes to services (from the system's locale.conf; the supervisor
passes its own)."""

RESTART_POLICIES = ("no", "always", "on-success", "on-failure", "on-abnormal", "on-abort", "on-watchdog")


@dataclass(frozen=True)
class UnitSpec:
    """What the supervisor takes from a unit file.

    Attributes:
        argv: ``ExecStart=`` split into words, systemd's escapes (``%%``, ``$$``) undone.
        env: ``Environment=`` assignments, in order.
        restart: the ``Restart=`` policy (``no`` when absent, as in systemd).
        restart_sec: ``RestartSec=`` in seconds (systemd's default 0.1).
        stop_timeout: ``TimeoutStopSec=`` in seconds, else :data:`STOP_TIMEOUT`.
        start_limit_burst / start_limit_interval: give up after this many starts within this many
            seconds (systemd's defaults 5 and 10 s).
        user / group: ``User=`` and ``Group=`` (names or numbers), or None.
        supplementary: ``SupplementaryGroups=``, in order.
        umask: ``UMask=`` (an octal number), or None to keep the supervisor's.
    """

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    restart: str = "no"
    restart_sec: float = 0.1
    stop_timeout: float = STOP_TIMEOUT
    start_limit_burst: int = 5
    start_limit_interval: float = 10.0
    user: str | None = None
    group: str | None = None
    supplementary: list[str] = field(default_factory=list)
    umask: int | None = None


_SPAN = re.compile(r"(\d+(?:\.\d+)?)\s*(us|ms|seconds?|sec|s|minutes?|min|m|hours?|hr|h)?")
_UNIT_SECONDS = {"us": 1e-6, "ms": 1e-3, "": 1.0, "s": 1.0, "sec": 1.0, "second": 1.0, "seconds": 1.0}
_UNIT_SECONDS |= {"m": 60.0, "min": 60.0, "minute": 60.0, "minutes": 60.0}
_UNIT_SECONDS |= {"h": 3600.0, "hr": 3600.0, "hour": 3600.0, "hours": 3600.0}


def parse_timespan(text: str, *, key: str) -> float:
    """Seconds in a systemd time span (``2s``, ``500ms``, ``1min 30s``, a bare number = seconds).

    Raises:
        ServiceError: ``text`` is not a time span (the message names ``key``).
    """
    rest, total = text.strip(), 0.0
    if not rest:
        raise ServiceError(f"{key}= is empty; give a time span such as 2s or 500ms")
    while rest:
        m = _SPAN.match(rest)
        if not m:
            raise ServiceError(f"{key}={text!r} is not a time span; use for example 2s, 500ms or 1min")
        total += float(m.group(1)) * _UNIT_SECONDS[m.group(2) or ""]
        rest = rest[m.end() :].lstrip()
    return total


def _unescape(word: str) -> str:
    return word.replace("%%", "%").replace("$$", "$")


def _words(value: str, key: str) -> list[str]:
    try:
        return shlex.split(value)
    except ValueError as e:
        raise ServiceError(f"{key}={value!r}: {e}") from e


def parse_unit(text: str) -> UnitSpec:
    """The :class:`UnitSpec` in a unit file's ``text``.

    Reads ``[Service]`` ``ExecStart=`` (the last one; a leading ``-@:+!`` prefix is dropped),
    ``Environment=`` (quoted words ``K=V``; an empty one clears), ``Restart=``, ``RestartSec=``,
    ``TimeoutStopSec=``, ``User=``, ``Group=``, ``SupplementaryGroups=`` (words; an empty one
    clears), ``UMask=`` (octal), and
    ``StartLimitBurst=``/``StartLimitIntervalSec=`` from ``[Unit]`` or ``[Service]``. Comments
    (``#``, ``;``) and line continuations (a trailing backslash) are handled; other keys ignored.

    Raises:
        ServiceError: no ``ExecStart=``, unbalanced quotes, an unknown ``Restart=`` value, or a
            bad number, time span or umask.
    """
    section, argv, env = "", list[str](), dict[str, str]()
    user: str | None = None
    group: str | None = None
    supplementary: list[str] = []
    umask: int | None = None
    restart, restart_sec, stop_timeout, burst, interval = "no", 0.1, STOP_TIMEOUT, 5, 10.0
    logical: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line[0] in "#;"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    for line in logical:
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, sep, value = line.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or section not in ("Service", "Unit"):
            continue
        if section == "Service" and key == "ExecStart" and value:
            words = [_unescape(w) for w in _words(value, key)]
            if words:
                words[0] = words[0].lstrip("-@:+!")
            argv = words
        elif section == "Service" and key == "Environment":
            if not value:
                env.clear()
            for word in _words(value, key):
                name, eq, val = word.partition("=")
                if not eq or not name:
                    raise ServiceError(f"Environment={value!r}: {word!r} is not NAME=VALUE")
                env[name] = val.replace("%%", "%")
        elif section == "Service" and key == "Restart":
            if value not in RESTART_POLICIES:
                raise ServiceError(f"Restart={value!r}; use one of {', '.join(RESTART_POLICIES)}")
            restart = value
        elif section == "Service" and key == "RestartSec":
            restart_sec = parse_timespan(value, key=key)
        elif section == "Service" and key == "TimeoutStopSec":
            stop_timeout = parse_timespan(value, key=key)
        elif section == "Service" and key == "User":
            user = value or None
        elif section == "Service" and key == "Group":
            group = value or None
        elif section == "Service" and key == "SupplementaryGroups":
            supplementary = [*supplementary, *_words(value, key)] if value else []
        elif section == "Service" and key == "UMask":
            try:
                umask = int(value, 8)
            except ValueError as e:
                raise ServiceError(f"UMask={value!r} is not an octal number such as 0077") from e
        elif key == "StartLimitIntervalSec":
            interval = parse_timespan(value, key=key)
        elif key == "StartLimitBurst":
            try:
                burst = int(value)
            except ValueError as e:
                raise ServiceError(f"StartLimitBurst={value!r} is not a whole number") from e
    if not argv:
        raise ServiceError("the unit has no ExecStart= in [Service]; it does not say what to run")
    return UnitSpec(
        argv, env, restart, restart_sec, stop_timeout, burst, interval, user, group, supplementary, umask
    )


@dataclass(frozen=True)
class Credentials:
    """Who the program runs as (:func:`credentials`).

    Attributes:
        user / group / extra_groups: for :class:`subprocess.Popen`'s ``user``, ``group`` and
            ``extra_groups`` (all None: run as the supervisor runs).
        env: ``HOME``, ``USER``, ``LOGNAME``, ``SHELL`` of that user (systemd sets them for ``User=``).
        note: why ``User=`` was not applied, for the log; "" when it was, or there was none.
    """

    user: int | None = None
    group: int | None = None
    extra_groups: list[int] | None = None
    env: dict[str, str] = field(default_factory=dict)
    note: str = ""


def _uid(name: str) -> pwd.struct_passwd:
    try:
        return pwd.getpwuid(int(name)) if name.isdigit() else pwd.getpwnam(name)
    except (KeyError, ValueError) as e:
        raise ServiceError(
            f"User={name}: no such user; 'llmgw server init' makes it "
            "(or: useradd --system --no-create-home --shell /usr/sbin/nologin llmgw)"
        ) from e


def _gid(name: str) -> int:
    try:
        return int(name) if name.isdigit() else grp.getgrnam(name).gr_gid
    except KeyError as e:
        raise ServiceError(f"Group={name}: no such group; create it (groupadd --system {name})") from e


def credentials(spec: UnitSpec, *, euid: int | None = None) -> Credentials:
    """The user, groups and environment ``spec``'s ``User=``/``Group=`` give the program.

    As systemd does: the gid is ``Group=``'s, else the user's primary group; the supplementary
    groups are the user's from the group database (``getgrouplist``) plus ``SupplementaryGroups=``,
    and never the supervisor's own (root's group 0 would otherwise stay). ``euid`` (default: this
    process's) other than 0 cannot switch users: the result then only carries a ``note`` (empty when
    ``User=`` already names this user).

    Raises:
        ServiceError: a user or group that does not exist.
    """
    euid = os.geteuid() if euid is None else euid
    if spec.user is None and spec.group is None and not spec.supplementary:
        return Credentials()
    pw = _uid(spec.user) if spec.user is not None else None
    if euid != 0:
        if pw is not None and pw.pw_uid != euid:
            return Credentials(note=(
                f"User={spec.user} not applied: only root can switch users, and this supervisor runs "
                f"as uid {euid}; the program runs as uid {euid} too"
            ))
        return Credentials()
    gid = _gid(spec.group) if spec.group is not None else (pw.pw_gid if pw is not None else None)
    groups = os.getgrouplist(pw.pw_name, gid if gid is not None else pw.pw_gid) if pw is not None else []
    groups += [_gid(g) for g in spec.supplementary]
    env = {}
    if pw is not None:
        env = {"HOME": pw.pw_dir, "USER": pw.pw_name, "LOGNAME": pw.pw_name, "SHELL": pw.pw_shell}
    return Credentials(
        user=pw.pw_uid if pw is not None else None,
        group=gid,
        extra_groups=list(dict.fromkeys(groups)),
        env=env,
    )


def service_env(spec: UnitSpec, who: Credentials, inherited: Mapping[str, str]) -> dict[str, str]:
    """The environment ``spec``'s program starts with, the supervisor's being ``inherited``.

    A program started as another user (``who.user`` set: a root supervisor applying ``User=``)
    gets what systemd gives a system service and nothing else of the supervisor's, whose
    environment is root's and may hold its secrets: :data:`SYSTEMD_PATH`, the locale
    (:data:`LOCALE_VARS` present in ``inherited``), the user's ``HOME``/``USER``/``LOGNAME``/
    ``SHELL``, then ``Environment=``. A program run as the supervisor's own user crosses no
    privilege boundary and keeps ``inherited`` (a laptop's or CI's PATH, proxies, tokens) under
    ``who.env`` and ``Environment=``. ``INVOCATION_ID`` is the caller's to add.
    """
    if who.user is None:
        return dict(inherited) | who.env | spec.env
    base = {"PATH": SYSTEMD_PATH} | {k: inherited[k] for k in LOCALE_VARS if k in inherited}
    return base | who.env | spec.env
