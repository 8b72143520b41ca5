"""Owners and modes of the files ``server init`` leaves: secrets 0600, state directories 0700.

Every file holding a secret is readable by one user only, and no directory llmgw makes is
writable by its group or by others (under the default umask the database with the replica keys was
readable by every local user). The control plane runs as the ``llmgw`` user when it can
(:func:`llmgw.service.users.choose_service_user`); then what it reads is that user's, and the rest
stays root's:

| path | owner | mode | why |
| --- | --- | --- | --- |
| ``/etc/llmgw/admin-token``, ``client-keys``, ``pki/server-key.pem`` | llmgw | 0600 | the server reads them |
| ``/etc/llmgw/mirror-token`` (a mirror on its own machine, or its copy) | llmgw | 0600 | mirror and server read it |
| ``/etc/llmgw/pki/ca-key.pem``, ``agent-key.pem`` | root | 0600 | init and the agent (root) only |
| ``/etc/llmgw/server.yaml`` | root, group llmgw | 0640 | the server reads it; may hold a store password |
| ``/var/lib/llmgw`` and the SQLite files in it | llmgw | 0700 / 0600 | replica keys |
| ``/var/lib/llmgw/services`` | root | 0700 | the supervisor's pid files and logs |
| ``/var/lib/llmgw-agent`` | root | 0700 | engines, cache, replica records with keys |
| ``/srv/models`` | llmgw | as made | the mirror writes it; weights are no secret |

Without a service user (not root, or llmgw cannot run this install) only the modes are set.
"""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
from pathlib import Path

from llmgw.errors import ServiceError
from llmgw.mirror.client import MIRROR_TOKEN
from llmgw.paths import Paths
from llmgw.service.users import chown_tree

SECRET_MODE = 0o600
PRIVATE_DIR_MODE = 0o700


def service_secrets(paths: Paths) -> list[Path]:
    """Secrets the control plane itself reads: owned by its user, 0600."""
    return [paths.admin_token, paths.client_keys, paths.pki / "server-key.pem", paths.etc / MIRROR_TOKEN]


def root_secrets(paths: Paths) -> list[Path]:
    """Secrets only root uses (init, ``server add-node``, the agent): root's, 0600."""
    return [paths.pki / "ca-key.pem", paths.etc / "agent-key.pem"]


def database_files(paths: Paths) -> list[Path]:
    """The SQLite database and its WAL files."""
    db = paths.database
    return [db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")]


def _set(path: Path, mode: int, uid: int = -1, gid: int = -1, *, directory: bool = False) -> None:
    """chown (when asked) and chmod ``path``; missing: nothing. It must not be a symlink (one
    where the llmgw user may write could point root's chmod anywhere), unless it is a
    ``directory`` in root's own tree (state moved to another disk).
    """
    with contextlib.suppress(FileNotFoundError):
        if path.is_symlink() and not directory:
            raise ServiceError(f"{path} is a symlink; llmgw's secret files must be real files: replace it")
        if uid != -1 or gid != -1:
            os.chown(path, uid, gid)
        os.chmod(path, mode)


def lock_down(paths: Paths, user: str | None) -> None:
    """Give every file and directory in the table of this module its owner and mode.

    ``user``: the control plane's and the mirror's user, or None to set modes only. Files not
    there yet are skipped (a later call, before each service starts, catches them).

    Raises:
        ServiceError: a chown or chmod failed, or one of these paths is a symlink.
    """
    uid = gid = -1
    if user is not None:
        try:
            pw = pwd.getpwnam(user)
            uid, gid = pw.pw_uid, grp.getgrgid(pw.pw_gid).gr_gid
        except KeyError as e:
            raise ServiceError(f"there is no user {user} (or its group) to give llmgw's files to") from e
    try:
        for path in service_secrets(paths):
            _set(path, SECRET_MODE, uid, gid)
        for path in root_secrets(paths):
            _set(path, SECRET_MODE, 0 if user is not None else -1, 0 if user is not None else -1)
        _set(paths.server_config, 0o640, -1, gid)
        _set(paths.state, PRIVATE_DIR_MODE, uid, gid, directory=True)
        for path in database_files(paths):
            _set(path, SECRET_MODE, uid, gid)
        _set(paths.supervisor, PRIVATE_DIR_MODE)  # inside llmgw's directory: a symlink is refused
        _set(paths.agent_state, PRIVATE_DIR_MODE, directory=True)
        if user is not None and paths.mirror_store.is_dir():
            chown_tree(paths.mirror_store, user)
    except OSError as e:
        raise ServiceError(f"setting the owners and modes of llmgw's files: {e}") from e
