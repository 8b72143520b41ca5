"""``server.yaml`` and ``agent.yaml``: Pydantic models, loading, and errors that name the field.

Both files reject unknown fields (a typo is an error, not a silently ignored setting). A file that
fails to load is never rewritten: :func:`load_server_config` and :func:`load_agent_config` only
read. ``server init`` appends blocks to ``server.yaml`` (with a timestamped backup) and never
rewrites it; ``agent.yaml`` is written once (only the llama-server init wrote there is updated,
see :mod:`llmgw.serverinit.agentconf`).

Listen addresses are ``HOST:PORT`` or ``:PORT`` (all interfaces).
"""

from __future__ import annotations

import errno
import ipaddress
import os
import pwd
import re
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from llmgw import yamlsafe
from llmgw.errors import ConfigError
from llmgw.guard.config import GuardConfig
from llmgw.names import check_labels, valid_name

MIN_TOKEN_CHARS = 16
"""The shortest admin or viewer token a control plane starts with (characters). Both log in to the
dashboard, where guesses are throttled to about one a minute (:mod:`llmgw.control.ui.throttle`);
16 characters of base64 (96 bits) are out of reach at any pace. The tokens ``server init`` makes
are 43 characters (256 bits)."""


def unreadable(path: Path, e: OSError) -> str:
    """Why ``path`` could not be read, for a message: ``e.strerror``, and for a permission denied the
    user this process runs as and how to let it read the file (the control plane and the mirror run
    as ``llmgw``: a file root made 0600, as the docs' token recipe does, is refused to them; a new
    user's finding)."""
    if e.errno != errno.EACCES:
        return str(e.strerror or e)
    try:
        user = pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        user = str(os.geteuid())
    return (f"{e.strerror} for user {user}, whom the service runs as; let it read the file "
            f"(chgrp {user} {path} && chmod g+r {path}) or put it where it can")


def check_token_length(token: str, path: Path) -> str:
    """``token`` (read from ``path``) when it has at least :data:`MIN_TOKEN_CHARS` characters.

    Raises:
        ConfigError: it is shorter; the message gives its length (never the token), the rule, and
            how to make a good one.
    """
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(
            f"{path} holds a {len(token)}-character token; a token that logs in to the dashboard must be at "
            f"least {MIN_TOKEN_CHARS} characters: make one with 'head -c 32 /dev/urandom | base64 > {path} && "
            f"chmod 600 {path}', then run 'llmgw service restart server'"
        )
    return token


def parse_listen(value: str) -> tuple[str, int]:
    """Split a listen address into ``(host, port)``.

    ``":8080"`` is ``("0.0.0.0", 8080)``; ``"127.0.0.1:9090"`` and ``"[::1]:9090"`` keep their host.

    Raises:
        ValueError: when there is no port, or it is not 1..65535.
    """
    host, sep, port_text = value.rpartition(":")
    if not sep or not port_text.isdigit():
        raise ValueError(f"'{value}' is not HOST:PORT or :PORT")
    port = int(port_text)
    if not 0 < port < 65536:
        raise ValueError(f"'{value}' has port {port}, outside 1..65535")
    host = host.strip("[]") or "0.0.0.0"
    return host, port


def loopback_url(url: str) -> bool:
    """Whether ``url``'s host is ``localhost`` or a loopback address (127.0.0.0/8, ``::1``): a URL only
    this machine reaches. A name is not resolved."""
    host = urllib.parse.urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_listen(value: str) -> str:
    parse_listen(value)
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TLSFiles(_Strict):
    """Paths of a CA bundle, a certificate and its key (PEM)."""

    ca: Path
    cert: Path
    key: Path

    def beside(self, base: Path) -> TLSFiles:
        """These paths with each relative one taken inside ``base`` (an absolute one is kept)."""
        return TLSFiles(ca=base / self.ca, cert=base / self.cert, key=base / self.key)


class GatewayConfig(_Strict):
    """The OpenAI-compatible gateway.

    ``allow_loopback_without_key``: a single-machine install lets clients on this machine ask
    without a key (init sets it, and says so in the file); every other client needs a key from
    ``keys_file`` (one per line).

    ``drain_s``: on SIGTERM (a stop or restart) the requests in flight may finish for this many
    seconds before they are cut with an error event (:mod:`llmgw.control.gateway.drain`); at most 50,
    inside the server unit's ``TimeoutStopSec=60s``.
    """

    listen: str = ":8080"
    keys_file: Path | None = None
    allow_loopback_without_key: bool = False
    drain_s: Annotated[float, Field(ge=0, le=50)] = 20.0

    _v = field_validator("listen")(classmethod(lambda cls, v: _check_listen(v)))


class StoreConfig(_Strict):
    """Where the control plane keeps its state: SQLite (embedded default) or PostgreSQL (HA).

    ``url`` is a SQLAlchemy URL (``sqlite:////var/lib/llmgw/llmgw.db`` or
    ``postgresql+psycopg://user:password@host:5432/llmgw``, libpq multi-host as
    ``postgresql+psycopg://user:password@/llmgw?host=a:5432&host=b:5432&target_session_attrs=read-write``;
    timeouts and keepalives default as :mod:`llmgw.control.store.postgres` says); empty means the
    SQLite file in the state dir.
    """

    url: str = ""


class ClusterConfig(_Strict):
    """``cluster``: this control plane as one member of an HA cluster (several control planes
    sharing one PostgreSQL database; :mod:`llmgw.control.reconcile.election`).

    Attributes:
        name: this control plane's name in ``llmgw ctl cluster`` (default: the host name).
        agent_url: how agents reach this control plane's agent API, ``https://HOST:7443``; sent to
            agents in heartbeat replies so they learn every member. Default: derived from
            ``agent_listen`` (the host name when it listens on every interface).
        patroni: the REST API URLs of the Patroni members (``http://HOST:8008``), read by
            ``llmgw ctl cluster`` to show the database's primary, replicas and lag.
        lease_s: a leader whose last successful renewal (a write) is older than this stops acting
            (seconds; docs/ha.md §3.3: 5 s stopped a leader on a frozen primary 4.3 s after the freeze).
        renew_s: seconds between the leader's renewals, and between a follower's tries.
        max_heartbeats_per_s: the heartbeats per second the agents of the whole cluster may send
            (Nomad's ``max_heartbeats_per_second``, 50 by default): the interval handed to agents is
            ``max(2 s, nodes / this)`` and node-lost detection grows with it
            (:mod:`llmgw.control.api.cadence`). 1 to 10,000.
        agent_api_process: serve the agent API from a process of its own, started and supervised by
            the control plane (:mod:`llmgw.control.agentproc`), so that heartbeats take none of the
            gateway's event loop: for large clusters (thousands of nodes; bench/scale.py measured the
            gateway's added latency while 5,000 nodes beat with and without it, docs/operating.md).
            Default off: one process, ~75 MiB less.
    """

    name: str = ""
    agent_url: str = ""
    patroni: list[str] = Field(default_factory=list)
    lease_s: Annotated[float, Field(gt=0, le=60)] = 5.0
    renew_s: Annotated[float, Field(gt=0, le=10)] = 1.0
    max_heartbeats_per_s: Annotated[float, Field(ge=1, le=10_000)] = 50.0
    agent_api_process: bool = False


class MirrorRef(_Strict):
    """The model mirror this control plane uses: its management API URL (``http://127.0.0.1:8082``)."""

    api: str = ""


class UiConfig(_Strict):
    """``ui``: the web dashboard (:mod:`llmgw.control.ui`).

    It is always at ``/ui/`` on the admin listener (loopback by default: reach it over SSH, e.g.
    ``ssh -L 9090:127.0.0.1:9090 HOST``). ``listen`` serves it on one more address too, over TLS
    with the cluster's server certificate (``tls.cert``/``tls.key``), e.g. ``":9443"``.

    Attributes:
        listen: an extra ``HOST:PORT`` for the dashboard alone (TLS); empty: none.
        session_ttl_s: seconds a login lasts (default 8 hours); then the page goes back to login.
        viewer_token_file: a token that logs in read-only (no actions); empty means
            ``viewer-token`` beside server.yaml when that file exists, else no read-only logins.
    """

    listen: str = ""
    session_ttl_s: Annotated[float, Field(gt=0, le=30 * 86400)] = 8 * 3600.0
    viewer_token_file: Path | None = None

    @field_validator("listen")
    @classmethod
    def _listen(cls, v: str) -> str:
        return _check_listen(v) if v else v

    def viewer_token(self, config_path: Path) -> str | None:
        """The read-only token, or None when there is no such file (or it is empty).

        Raises:
            ConfigError: ``viewer_token_file`` is set but cannot be read, or the token is shorter
                than :data:`MIN_TOKEN_CHARS`.
        """
        path = self.viewer_token_file or config_path.parent / "viewer-token"
        try:
            text = path.read_text().strip()
        except FileNotFoundError:
            if self.viewer_token_file is None:
                return None
            raise ConfigError(f"ui.viewer_token_file {path} does not exist; create it or remove the setting") from None
        except OSError as e:
            raise ConfigError(f"ui.viewer_token_file {path} cannot be read: {unreadable(path, e)}") from e
        return check_token_length(text.splitlines()[0].strip(), path) if text else None


class ServerConfig(_Strict):
    """``/etc/llmgw/server.yaml``.

    Attributes:
        admin_listen: admin API address (bearer token), ``127.0.0.1:9090``.
        agent_listen: agent API address (TLS, client certificates from the CA), ``:7443``.
        admin_token_file: the admin token's file; empty means ``admin-token`` beside server.yaml.
        tls: the server certificate for the agent API and the CA that signs agents.
        node_lost_after_s: seconds without a heartbeat after which a node is ``lost`` (its
            replicas stay while their engines answer the control plane's health probe).
        backoff_reset_s: seconds a replica must have been ready for its crash count (and so its
            restart backoff, 10 s doubling to 5 min) to go back to zero.
        guard: guardrail policies (:mod:`llmgw.guard.config`); none means guardrails are off.
        max_replicas_per_model: the most replicas one model may ask for (``scaling.min``/``max``);
            the admin API refuses more with a 400. Default 1,000; at most
            :data:`llmgw.catalog.MAX_REPLICAS_HARD` (100,000).
        ui: the web dashboard (:class:`UiConfig`).
    """

    admin_listen: str = "127.0.0.1:9090"
    agent_listen: str = ":7443"
    admin_token_file: Path | None = None
    tls: TLSFiles
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    mirror: MirrorRef = Field(default_factory=MirrorRef)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    guard: GuardConfig = Field(default_factory=GuardConfig)
    ui: UiConfig = Field(default_factory=UiConfig)
    node_lost_after_s: Annotated[float, Field(gt=0)] = 30.0
    backoff_reset_s: Annotated[float, Field(gt=0, le=30 * 86400)] = 600.0
    max_replicas_per_model: Annotated[int, Field(strict=True, ge=1, le=100_000)] = 1000

    _v = field_validator("admin_listen", "agent_listen")(classmethod(lambda cls, v: _check_listen(v)))

    def admin_token_path(self, config_path: Path) -> Path:
        """The admin token file: ``admin_token_file``, else ``admin-token`` beside ``config_path``."""
        return self.admin_token_file or config_path.parent / "admin-token"

    def read_admin_token(self, config_path: Path) -> str:
        """The admin token (first line of its file, stripped).

        Raises:
            ConfigError: the file is missing, unreadable (not root?) or empty.
        """
        path = self.admin_token_path(config_path)
        try:
            token = path.read_text().strip()
        except FileNotFoundError as e:
            raise ConfigError(
                f"the admin token file {path} does not exist; run 'llmgw server init' or set admin_token_file"
            ) from e
        except OSError as e:
            raise ConfigError(
                f"the admin token file {path} cannot be read: {e.strerror}; run as root or pass --token"
            ) from e
        if not token:
            raise ConfigError(f"the admin token file {path} is empty; put a long random token in it (mode 0600)")
        return token.splitlines()[0].strip()


class LlamacppEngine(_Strict):
    """``engines.llamacpp``: ``binary`` is a llama-server to use instead of PATH or the agent's own.

    Without one, a CPU node downloads the pinned release (:mod:`llmgw.agent.engines.provision`):
    ``release_url`` replaces GitHub's releases download base (a mirror), ``variant: vulkan`` takes
    the Vulkan build instead of the CPU one.
    """

    binary: Path | None = None
    release_url: str = ""
    variant: Literal["", "vulkan"] = ""


class VllmEngine(_Strict):
    """``engines.vllm``: ``binary`` is a ``vllm`` executable to use instead of the agent's own venv."""

    binary: Path | None = None


#: The environment variable that sets ``engines.max_threads`` where agent.yaml does not: one line in
#: the agent's environment for every agent a machine runs (``scripts/test`` sets it to 1).
MAX_THREADS_ENV = "LLMGW_ENGINE_MAX_THREADS"


class EnginesConfig(_Strict):
    """``engines``: per-engine settings.

    ``max_threads``: the most compute threads an engine started by this agent runs (llama-server's
    ``--threads``/``--threads-batch``, a group worker's rpc-server ``--threads``), where its profile
    does not set them; unset, as many as the replica's cores (the cores it is pinned to, its
    profile's ``cpu_cores``, else the node's). For a node whose cores other work shares, unpinned: the
    threads of one llama.cpp step wait for each other, and while another process holds a core the
    waits dominate. Measured on 2 cores (2026-12-06, three 64-token answers of gemma-3-270m): 2
    threads 5.3-5.7 CPU-s in 2.7-2.9 s idle, 12-28 CPU-s in 12-28 s beside two busy loops; 1 thread
    3.7 CPU-s in 3.7 s idle, 3.9 CPU-s in 6.0-6.3 s beside them. Where unset here,
    :data:`MAX_THREADS_ENV` in the agent's environment sets it (:meth:`AgentConfig.engine_max_threads`).
    """

    llamacpp: LlamacppEngine = Field(default_factory=LlamacppEngine)
    vllm: VllmEngine = Field(default_factory=VllmEngine)
    max_threads: Annotated[int, Field(ge=1, strict=True)] | None = None  # strict: `true` is not 1


class DiscoveryConfig(_Strict):
    """``discovery``: ``inventory_file`` declares the inventory instead of reading it (tests, odd hardware)."""

    inventory_file: Path | None = None


class AgentConfig(_Strict):
    """``/etc/llmgw/agent.yaml``: this node's agent.

    Attributes:
        server: the control plane's agent API, ``https://HOST:7443``.
        servers: more control planes' agent APIs (HA): the agent sticks to one that answers and
            rotates through ``server`` then ``servers`` (then the members heartbeat replies name)
            when it fails. Either field may be empty, not both.
        node_id: this node's id; must equal the CN of ``tls.cert`` (the server believes only the cert);
            a name of :mod:`llmgw.names` (lowercase letters, digits, ``.``, ``_``, ``-``, at most 63).
        labels: placement's ``node_selector`` matches them; keys are label keys of :mod:`llmgw.names`.
        advertise_address: the address engines bind and the gateway dials, ``127.0.0.1`` on one machine.
        heartbeat_interval_s: seconds between heartbeats.
        cache_max_gb: node model cache size past which least recently used files are evicted (GB).
    """

    server: str = ""
    servers: list[str] = Field(default_factory=list)
    node_id: Annotated[str, valid_name("node id")]
    tls: TLSFiles
    labels: Annotated[dict[str, str], AfterValidator(check_labels)] = Field(default_factory=dict)
    engines: EnginesConfig = Field(default_factory=EnginesConfig)
    discovery: DiscoveryConfig = Field(default_factory=DiscoveryConfig)
    advertise_address: str = "127.0.0.1"
    heartbeat_interval_s: Annotated[float, Field(gt=0)] = 2.0
    cache_max_gb: Annotated[float, Field(gt=0)] | None = None

    def engine_max_threads(self, environ: Mapping[str, str]) -> int | None:
        """``engines.max_threads``, else :data:`MAX_THREADS_ENV` in ``environ``, else None (no cap).

        Raises:
            ConfigError: the variable is set but not a whole number of at least 1.
        """
        if self.engines.max_threads is not None:
            return self.engines.max_threads
        raw = environ.get(MAX_THREADS_ENV, "").strip()
        if not raw:
            return None
        if not re.fullmatch(r"[0-9]+", raw) or int(raw) < 1:  # not str.isdigit: it takes '²' and '١'
            raise ConfigError(
                f"{MAX_THREADS_ENV}={raw!r}: the most threads an engine runs must be a whole number of at least 1; "
                f"set it so (e.g. {MAX_THREADS_ENV}=1) or unset it"
            )
        return int(raw)

    @field_validator("server")
    @classmethod
    def _https(cls, v: str) -> str:
        if v and not v.startswith("https://"):
            raise ValueError(f"'{v}' must be an https:// URL of the control plane's agent API")
        return v

    @field_validator("servers")
    @classmethod
    def _https_all(cls, v: list[str]) -> list[str]:
        for url in v:
            cls._https(url)
        return v

    @model_validator(mode="after")
    def _some_server(self) -> AgentConfig:
        if not self.server and not self.servers:
            raise ValueError("give the control plane's agent API as 'server' (or several as 'servers')")
        return self

    @property
    def control_planes(self) -> list[str]:
        """``server`` then ``servers``, each once, in that order: the agent's starting list."""
        return list(dict.fromkeys(u for u in [self.server, *self.servers] if u))


M = TypeVar("M", bound=BaseModel)


def describe_validation_error(path: Path, err: ValidationError) -> str:
    """One line per problem: ``<file>: <dotted.field>: <what is wrong>``."""
    lines = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown field; remove it or check its spelling"
        elif e["type"] == "missing":
            msg = "required field is missing"
        lines.append(f"{path}: {field}: {msg}")
    return "\n".join(lines)



def load_yaml_model(path: Path, model: type[M]) -> M:
    """Read ``path`` as YAML and validate it as ``model``.

    Raises:
        ConfigError: the file is missing, is not valid YAML, is not a mapping, or a field is wrong;
            the message names the file and the field.
    """
    try:
        text = path.read_text()
    except FileNotFoundError as e:
        raise ConfigError(f"{path} does not exist; run 'llmgw server init' or pass --config") from e
    except OSError as e:
        raise ConfigError(f"{path} cannot be read: {unreadable(path, e)}") from e
    try:
        data: Any = yamlsafe.load(text)
    except yamlsafe.DuplicateKeyError as e:
        raise ConfigError(f"{path}: {e.problem}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: {yamlsafe.problem(e)}; fix the file") from e
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of fields, not {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ConfigError(describe_validation_error(path, e)) from e


def load_server_config(path: Path) -> ServerConfig:
    """Load ``server.yaml``. Raises :class:`ConfigError` naming the file and field."""
    return load_yaml_model(path, ServerConfig)


def load_agent_config(path: Path) -> AgentConfig:
    """Load ``agent.yaml``, a relative ``tls`` path taken in the file's own directory.

    ``server add-node`` writes ``tls: {ca: ca.pem, cert: agent.pem, ...}`` beside agent.yaml, so its
    directory works wherever it is copied: ``/etc/llmgw`` on a node, ``$LLMGW_ROOT/etc/llmgw`` under
    ``--root`` (absolute ``/etc/llmgw/...`` paths failed there), or read in place with ``--config``.

    Raises:
        ConfigError: naming the file and field.
    """
    cfg = load_yaml_model(path, AgentConfig)
    return cfg.model_copy(update={"tls": cfg.tls.beside(path.absolute().parent)})
