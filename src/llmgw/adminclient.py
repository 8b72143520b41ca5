"""A sync client of the control plane's admin API (used by ``server init`` and ``llmgw ctl``).

Every ``/api/v1/...`` path the installer and the CLI use is a typed method here (``nodes()``,
``replicas(model)``, ``explain(model)``, ``add_model(spec)``, ...), returning the admin API's view
models (:mod:`llmgw.views`, :mod:`llmgw.control.api.openapi`) where the API has one and
the decoded JSON object where it does not (a model's resources, the guard's answers); callers
never spell a path. ``get``/``post``/``patch``/``put``/``delete`` stay for paths without a method.

Errors: a connection failure is :class:`~llmgw.errors.UnreachableError` (with what to run);
an error answer is :class:`~llmgw.errors.ApiError` carrying the status and the body's code; an
answer that is not the view it should be is an ApiError too (status 502, code ``bad_answer``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlencode

import httpx
from pydantic import BaseModel, ValidationError

from llmgw.config import load_server_config, loopback_url, parse_listen
from llmgw.errors import ApiError, UnreachableError, error_fields
from llmgw.httpverify import verify_context
from llmgw.names import path_segment
from llmgw.paths import Paths
from llmgw.views import (
    AutoscaleView,
    ClusterView,
    ExplainView,
    KeyView,
    LogView,
    ModelView,
    NewKeyView,
    NodeRemovalView,
    NodeView,
    ReplicaView,
    RevocationView,
    UsageView,
)

V = TypeVar("V", bound=BaseModel)


def _view(view: type[V], body: Any, what: str) -> V:
    """``body`` read as the admin API's ``view``; an answer of another shape is an
    :class:`~llmgw.errors.ApiError` (status 502) naming the call, not a pydantic traceback."""
    try:
        return view.model_validate(body)
    except ValidationError as e:
        raise ApiError(
            f"{what}: the control plane answered a {view.__name__} this client cannot read ({e.error_count()} "
            f"problem(s), first: {e.errors()[0]['loc']} {e.errors()[0]['msg']}); are llmgw and the server "
            "the same version?",
            status=502, code="bad_answer",
        ) from e


def connect_host(host: str) -> str:
    """The host to connect to for a listener bound to ``host``: loopback for the wildcard addresses
    (``0.0.0.0``, ``::``, empty), an IPv6 literal in brackets, else ``host`` itself."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


ASK_TIMEOUT_S = 5.0
"""Seconds a command waits on the admin API for a check it makes on the side (``mirror rm`` asking which
models use an entry, ``server add-node`` whether the node exists), not for its own work."""


@dataclass
class AdminClient:
    """The admin API at ``base_url`` with the bearer ``token``; ``transport`` is a seam for tests."""

    base_url: str
    token: str
    timeout_s: float = 15.0
    transport: httpx.BaseTransport | None = None

    @classmethod
    def from_paths(
        cls, paths: Paths, *, server: str | None = None, token: str | None = None, timeout_s: float = 15.0
    ) -> AdminClient:
        """The client for this machine's control plane: ``admin_listen`` and the token file of server.yaml
        (``timeout_s``: per request; :data:`ASK_TIMEOUT_S` for a courtesy check another command makes).

        Raises:
            ConfigError: server.yaml or the token file cannot be read (and no override was given).
        """
        if server and token:
            return cls(server.rstrip("/"), token, timeout_s)
        cfg = load_server_config(paths.server_config)
        host, port = parse_listen(cfg.admin_listen)
        base = server or f"http://{connect_host(host)}:{port}"
        if token is None:
            token = cfg.read_admin_token(paths.server_config)
        return cls(base.rstrip("/"), token, timeout_s)

    def _request(self, method: str, path: str, body: Any = None) -> Any:
        try:
            with httpx.Client(timeout=self.timeout_s, transport=self.transport, verify=verify_context()) as c:
                r = c.request(
                    method, self.base_url + path, json=body,
                    headers={"Authorization": f"Bearer {self.token}"},
                )
        except httpx.HTTPError as e:
            where = (
                "check it with 'llmgw service status'" if loopback_url(self.base_url)
                else "check the URL, and 'llmgw service status' on that machine"
            )
            raise UnreachableError(
                f"the control plane's admin API at {self.base_url} does not answer ({e.__class__.__name__}: {e}); "
                + where
            ) from e
        if r.status_code >= 400:
            code, message = error_fields(r.text, limit=1000)
            if not code:  # every answer of llmgw's admin API carries one: something else answered
                message = (f"{message or '(no body)'}; that is not an answer of llmgw's admin API: is "
                           f"{self.base_url} a control plane's admin_listen (server.yaml)?")
            raise ApiError(f"{method} {path}: {r.status_code} {message}", status=r.status_code, code=code)
        return r.json() if r.content else None

    def get(self, path: str) -> Any:
        """GET ``path`` (``/api/v1/...``) and return the decoded JSON."""
        return self._request("GET", path)

    def post(self, path: str, body: Any) -> Any:
        """POST JSON ``body`` to ``path`` and return the decoded JSON."""
        return self._request("POST", path, body)

    def patch(self, path: str, body: Any) -> Any:
        """PATCH ``path`` with the JSON merge patch ``body`` and return the decoded JSON."""
        return self._request("PATCH", path, body)

    def put(self, path: str, body: Any) -> Any:
        """PUT JSON ``body`` to ``path`` and return the decoded JSON."""
        return self._request("PUT", path, body)

    def delete(self, path: str) -> Any:
        """DELETE ``path`` and return the decoded JSON (None when empty)."""
        return self._request("DELETE", path)

    # --- typed methods, one per admin API call ------------------------------------------------------

    def nodes(self) -> list[NodeView]:
        """``GET /api/v1/nodes``: every node with its state, engines, resources and problems."""
        return [_view(NodeView, n, "GET /api/v1/nodes") for n in self.get("/api/v1/nodes")]

    def node_action(self, node: str, action: str) -> NodeView:
        """``POST /api/v1/nodes/{node}/{action}``; ``action`` is ``cordon``, ``uncordon`` or ``drain``."""
        path = f"/api/v1/nodes/{path_segment(node)}/{action}"
        return _view(NodeView, self.post(path, None), f"POST {path}")

    def remove_node(self, node: str, *, force: bool = False) -> NodeRemovalView:
        """``DELETE /api/v1/nodes/{node}`` (``?force=true`` drains it first); what was drained and revoked.

        Raises:
            ApiError: 409 ``node_busy`` when replicas are placed there and ``force`` is False.
        """
        path = f"/api/v1/nodes/{path_segment(node)}" + ("?force=true" if force else "")
        return _view(NodeRemovalView, self.delete(path), f"DELETE {path}")

    def revocation(self, serial: str, *, node: str = "", issued_at: float | None = None) -> RevocationView | None:
        """``GET /api/v1/revocations/{serial}``: the revocation of agent certificate ``serial``
        (upper-case hex), or None when it is not revoked (404). With ``node`` and ``issued_at``
        (unix seconds, :func:`llmgw.tlsconf.issued_at`), a certificate for a node removed after it
        was issued counts as revoked too, as the agent API refuses it."""
        path = f"/api/v1/revocations/{path_segment(serial)}"
        if node and issued_at is not None:
            path += f"?{urlencode({'node': node, 'issued_at': f'{issued_at:.0f}'})}"
        try:
            return _view(RevocationView, self.get(path), f"GET {path}")
        except ApiError as e:
            if e.status == 404 and e.code == "not_revoked":
                return None
            raise

    def models(self) -> list[ModelView]:
        """``GET /api/v1/models``: the catalog, broken rows included (``broken`` says why)."""
        return [_view(ModelView, m, "GET /api/v1/models") for m in self.get("/api/v1/models")]

    def model(self, name: str) -> ModelView:
        """``GET /api/v1/models/{name}`` (name or alias). Raises ApiError 404 when there is none."""
        path = f"/api/v1/models/{path_segment(name)}"
        return _view(ModelView, self.get(path), f"GET {path}")

    def add_model(self, spec: Any) -> ModelView:
        """``POST /api/v1/models`` with a catalog entry (a JSON object); the model as added."""
        return _view(ModelView, self.post("/api/v1/models", spec), "POST /api/v1/models")

    def patch_model(self, name: str, patch: dict[str, Any]) -> ModelView:
        """``PATCH /api/v1/models/{name}`` with a JSON merge patch; the model as saved."""
        path = f"/api/v1/models/{path_segment(name)}"
        return _view(ModelView, self.patch(path, patch), f"PATCH {path}")

    def set_profiles(self, name: str, profiles: Any) -> ModelView:
        """``PUT /api/v1/models/{name}/profiles`` (a list of profiles, or ``{profiles: [...]}``)."""
        path = f"/api/v1/models/{path_segment(name)}/profiles"
        return _view(ModelView, self.put(path, profiles), f"PUT {path}")

    def remove_model(self, name: str) -> None:
        """``DELETE /api/v1/models/{name}``: its replicas stop at their nodes' next heartbeat."""
        self.delete(f"/api/v1/models/{path_segment(name)}")

    def model_resources(self, name: str) -> dict[str, Any]:
        """``GET /api/v1/models/{name}/resources``: per profile what one replica needs and where it fits."""
        got: dict[str, Any] = self.get(f"/api/v1/models/{path_segment(name)}/resources")
        return got

    def model_autoscale(self, name: str) -> AutoscaleView:
        """``GET /api/v1/models/{name}/autoscale``: wanted, ready, draining, load, last decisions."""
        path = f"/api/v1/models/{path_segment(name)}/autoscale"
        return _view(AutoscaleView, self.get(path), f"GET {path}")

    def replicas(self, model: str | None = None) -> list[ReplicaView]:
        """``GET /api/v1/replicas`` (``?model=`` for one model's), wanted-but-unplaced ones included
        as ``pending`` on no node."""
        path = "/api/v1/replicas" + (f"?{urlencode({'model': model})}" if model else "")
        return [_view(ReplicaView, r, f"GET {path}") for r in self.get(path)]

    def replica_logs(self, replica: str, *, lines: int | None = None, offset: int | None = None) -> LogView:
        """``GET /api/v1/replicas/{replica}/logs``: the last ``lines``, or what came after ``offset``."""
        query = {k: v for k, v in (("lines", lines), ("offset", offset)) if v is not None}
        path = f"/api/v1/replicas/{path_segment(replica)}/logs" + (f"?{urlencode(query)}" if query else "")
        return _view(LogView, self.get(path), f"GET {path}")

    def restart_replica(self, replica: str) -> ReplicaView:
        """``POST /api/v1/replicas/{replica}/restart``: the replica that replaces it."""
        path = f"/api/v1/replicas/{path_segment(replica)}/restart"
        return _view(ReplicaView, self.post(path, None), f"POST {path}")

    def explain(self, model: str) -> ExplainView:
        """``GET /api/v1/explain-placement?model=``: why the model runs where it does, or nowhere."""
        path = f"/api/v1/explain-placement?{urlencode({'model': model})}"
        return _view(ExplainView, self.get(path), f"GET {path}")

    def cluster(self) -> ClusterView:
        """``GET /api/v1/cluster``: the control planes, which one leads, the term, whether the
        answering one reaches the database, and the database's members from Patroni."""
        return _view(ClusterView, self.get("/api/v1/cluster"), "GET /api/v1/cluster")

    def create_key(self, spec: dict[str, Any]) -> NewKeyView:
        """``POST /api/v1/keys`` (an :class:`~llmgw.apikeys.KeySpec` as JSON): the key and its secret."""
        return _view(NewKeyView, self.post("/api/v1/keys", spec), "POST /api/v1/keys")

    def keys(self) -> list[KeyView]:
        """``GET /api/v1/keys``: every key (never a secret), its limits, state and usage."""
        return [_view(KeyView, k, "GET /api/v1/keys") for k in self.get("/api/v1/keys")]

    def key(self, name: str) -> KeyView:
        """``GET /api/v1/keys/{name}``: one key as the list shows it. ApiError 404 ``key_not_found``."""
        path = f"/api/v1/keys/{path_segment(name)}"
        return _view(KeyView, self.get(path), f"GET {path}")

    def set_key(self, name: str, patch: dict[str, Any]) -> KeyView:
        """``PATCH /api/v1/keys/{name}`` (a :class:`~llmgw.apikeys.KeyPatch` as JSON): the key as changed."""
        path = f"/api/v1/keys/{path_segment(name)}"
        return _view(KeyView, self.patch(path, patch), f"PATCH {path}")

    def revoke_key(self, name: str) -> KeyView:
        """``POST /api/v1/keys/{name}/revoke``."""
        path = f"/api/v1/keys/{path_segment(name)}/revoke"
        return _view(KeyView, self.post(path, None), f"POST {path}")

    def rotate_key(self, name: str) -> NewKeyView:
        """``POST /api/v1/keys/{name}/rotate``: the key with its new secret."""
        path = f"/api/v1/keys/{path_segment(name)}/rotate"
        return _view(NewKeyView, self.post(path, None), f"POST {path}")

    def usage(self, *, key: str | None = None, model: str | None = None, since: str = "7d",
              until: str | None = None) -> list[UsageView]:
        """``GET /api/v1/usage``: rows per key, model and UTC day."""
        query = {"key": key, "model": model, "since": since, "until": until}
        path = "/api/v1/usage?" + urlencode({k: v for k, v in query.items() if v})
        return [_view(UsageView, u, f"GET {path}") for u in self.get(path)]

    def guard_status(self) -> dict[str, Any]:
        """``GET /api/v1/guard/status``: each policy's judges, their replicas and judge times."""
        got: dict[str, Any] = self.get("/api/v1/guard/status")
        return got

    def enable_judge(self, name: str, body: dict[str, str]) -> dict[str, Any]:
        """``POST /api/v1/guard/judges/{name}/enable`` (``repo``/``file``/``format`` for an unknown one)."""
        got: dict[str, Any] = self.post(f"/api/v1/guard/judges/{path_segment(name)}/enable", body)
        return got

    def guard_test(self, body: dict[str, str]) -> dict[str, Any]:
        """``POST /api/v1/guard/test``: judge a text as the gateway would (verdict, categories, time)."""
        got: dict[str, Any] = self.post("/api/v1/guard/test", body)
        return got

    def health_pid(self) -> int | None:
        """The control plane's pid from ``GET /api/v1/health``; None when nothing (or no llmgw) answers."""
        try:
            with httpx.Client(timeout=2.0, transport=self.transport, verify=verify_context()) as c:
                r = c.get(self.base_url + "/api/v1/health")
                pid = r.json().get("pid") if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
        return pid if isinstance(pid, int) and not isinstance(pid, bool) else None

    def health(self) -> bool:
        """True when ``GET /api/v1/health`` answers 200 (no token needed)."""
        try:
            with httpx.Client(timeout=2.0, transport=self.transport, verify=verify_context()) as c:
                return c.get(self.base_url + "/api/v1/health").status_code == 200
        except httpx.HTTPError:
            return False

