"""Every file path llmgw uses, from one :class:`Paths` object.

``LLMGW_ROOT=/some/dir`` (or ``llmgw --root DIR``) prefixes all of them, so tests and unprivileged
users run the whole system inside a directory. The layout (``/etc/llmgw``, ``/var/lib/llmgw``,
``/var/lib/llmgw-agent``, ``/srv/models``, ``/etc/systemd/system``) is the properties below;
docs/install.md says which step of ``server init`` writes what.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

ROOT_ENV = "LLMGW_ROOT"


@dataclass(frozen=True)
class Paths:
    """The file layout under ``root`` (``/`` on a real install).

    Attributes:
        root: the prefix of every path; ``Path("/")`` unless ``LLMGW_ROOT``/``--root`` is set.
    """

    root: Path = Path("/")

    @classmethod
    def from_env(cls, root: str | os.PathLike[str] | None = None) -> Paths:
        """The paths for ``root``, else ``$LLMGW_ROOT``, else ``/``. The root is made absolute."""
        value = root if root is not None else os.environ.get(ROOT_ENV) or "/"
        return cls(Path(value).resolve())

    @property
    def prefixed(self) -> bool:
        """True when the root is not ``/`` (a test or unprivileged install)."""
        return self.root != Path("/")

    def _p(self, absolute: str) -> Path:
        return self.root / absolute.lstrip("/")

    # /etc/llmgw
    @property
    def etc(self) -> Path:
        """``/etc/llmgw``: configs, the admin token, this node's identity."""
        return self._p("/etc/llmgw")

    @property
    def server_config(self) -> Path:
        """``/etc/llmgw/server.yaml``: the control plane's config."""
        return self.etc / "server.yaml"

    @property
    def admin_token(self) -> Path:
        """``/etc/llmgw/admin-token``: the admin API's bearer token, mode 0600."""
        return self.etc / "admin-token"

    @property
    def client_keys(self) -> Path:
        """``/etc/llmgw/client-keys``: gateway API keys, one per line, mode 0600."""
        return self.etc / "client-keys"

    @property
    def pki(self) -> Path:
        """``/etc/llmgw/pki``: the cluster CA and the server certificate."""
        return self.etc / "pki"

    @property
    def agent_config(self) -> Path:
        """``/etc/llmgw/agent.yaml``: this node's agent config; written once (see :mod:`llmgw.serverinit.agentconf`)."""
        return self.etc / "agent.yaml"

    @property
    def systemd_units(self) -> Path:
        """``/etc/systemd/system``: where the llmgw units are written."""
        return self._p("/etc/systemd/system")

    def unit(self, service: str) -> Path:
        """``/etc/systemd/system/llmgw-<service>.service`` (service: server, agent or mirror)."""
        return self.systemd_units / f"llmgw-{service}.service"

    @property
    def mirror_store(self) -> Path:
        """``/srv/models``: the mirror's store, ``<model>/<version>/<file>`` plus manifests."""
        return self._p("/srv/models")

    @property
    def state(self) -> Path:
        """``/var/lib/llmgw``: control plane state (the SQLite database by default)."""
        return self._p("/var/lib/llmgw")

    @property
    def database(self) -> Path:
        """``/var/lib/llmgw/llmgw.db``: the embedded SQLite store."""
        return self.state / "llmgw.db"

    @property
    def supervisor(self) -> Path:
        """``/var/lib/llmgw/services``: pid files and logs of llmgw's own supervisor (no systemd)."""
        return self.state / "services"

    @property
    def init_lock(self) -> Path:
        """``/var/lib/llmgw/init.lock``: held by ``server init`` while it runs."""
        return self.state / "init.lock"

    @property
    def agent_state(self) -> Path:
        """``/var/lib/llmgw-agent``: engines installed, model cache, running replicas."""
        return self._p("/var/lib/llmgw-agent")


def exists_or_hidden(path: Path) -> bool:
    """Whether ``path`` exists, or may: True when a parent this user may not enter hides it
    (``Path.exists`` raises PermissionError then on Python 3.11; /var/lib/llmgw is the llmgw user's,
    mode 0700), so a caller neither reports it missing nor removes it."""
    try:
        return path.exists()
    except OSError:
        return True
