"""The ``llmgw`` system user the mirror's unit runs as (``User=llmgw``, the seed's mirror unit).

Under systemd the mirror runs unprivileged and may write only its store (``ReadWritePaths=``), so
the user must exist and own the store before the unit starts (the seed's ``chown``). Under llmgw's
own supervisor the mirror runs as whoever started it and none of this applies.
"""

from __future__ import annotations

import pwd
from collections.abc import Callable
from pathlib import Path

from llmgw.errors import ServiceError
from llmgw.service.manager import CommandResult, run_command

MIRROR_USER = "llmgw"


def user_exists(name: str) -> bool:
    """True when the system has a user called ``name``."""
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def ensure_mirror_user(
    store: Path, *, runner: Callable[[list[str]], CommandResult] = run_command,
    exists: Callable[[str], bool] = user_exists,
) -> bool:
    """Make the ``llmgw`` system user when missing, and give it the mirror's store; True when the
    user was made.

    Raises:
        ServiceError: ``useradd`` or ``chown`` failed (their output in the message).
    """
    made = False
    if not exists(MIRROR_USER):
        argv = ["useradd", "--system", "--no-create-home", "--home-dir", "/nonexistent",
                "--shell", "/usr/sbin/nologin", MIRROR_USER]
        done = runner(argv)
        if done.returncode != 0:
            raise ServiceError(f"{' '.join(argv)}: {done.output.strip()}; create the user {MIRROR_USER} by hand")
        made = True
    done = runner(["chown", "-R", f"{MIRROR_USER}:{MIRROR_USER}", str(store)])
    if done.returncode != 0:
        raise ServiceError(f"chown -R {MIRROR_USER} {store}: {done.output.strip()}")
    return made
