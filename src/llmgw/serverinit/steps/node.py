"""Step 5: this machine as a node of its own control plane. Its agent certificate, agent.yaml
(written once; only the llama-server init itself put there is updated by a later
``--llama-server``, and on an HA cluster the control planes it lacks are added to ``servers``,
see :mod:`llmgw.serverinit.agentconf`), the agent service, and a wait until it reports a
llama.cpp engine."""

from __future__ import annotations

import shutil
import socket
import time
from pathlib import Path

from cryptography import x509
from cryptography.x509.oid import NameOID

from llmgw import tlsconf
from llmgw.agent.node.discovery import has_nvidia_device
from llmgw.catalog import engine_traits
from llmgw.config import load_agent_config, parse_listen
from llmgw.errors import ApiError, ConfigError, EngineError, LlmgwError, PkiError
from llmgw.names import check_name
from llmgw.serverinit import agentconf, files, plan
from llmgw.serverinit.onboard import ha_servers
from llmgw.serverinit.steps import services
from llmgw.serverinit.steps.context import InitContext, url_host
from llmgw.serverinit.steps.pki import reachable_addr
from llmgw.serverinit.wait import PROBE_TIMEOUT_S
from llmgw.service.units import agent_unit
from llmgw.tlsconf import CA


def node_id(given: str) -> str:
    """This node's id: ``given`` (``--node-id``), else the hostname, lowercased (:mod:`llmgw.names`).

    Raises:
        ConfigError: no hostname, or not a valid name (the message says to pass ``--node-id``).
    """
    node = given or socket.gethostname().lower()
    if not node:
        raise ConfigError("this machine has no hostname to use as its node id; pass --node-id")
    try:
        return check_name(node, "node id")
    except ValueError as e:
        raise ConfigError(f"{e}; pass --node-id NAME") from e


def run(ctx: InitContext) -> str:
    """Make this machine an agent of its own control plane and wait until it has an engine;
    returns the node id.

    Raises:
        PkiError: the CA key is not here to issue the agent's certificate.
        EngineError: the node's llama.cpp failed to install.
        WaitTimeout: the node was not ready with an engine within ``--node-wait``.
    """
    node = node_id(ctx.opts.node_id)
    classes = ctx.gpu_probe()
    if classes:
        ctx.say("kept", f"{len(classes)} NVIDIA GPU class(es) here: {', '.join(classes)} — the node will use them")
    elif has_nvidia_device():
        ctx.say(
            "!!",
            "an NVIDIA card is on the PCI bus but nvidia-smi does not answer: install the driver and "
            "run init again to serve on it; until then this node is CPU only",
        )
    else:
        ctx.say("kept", "no NVIDIA GPU here; the node serves on CPU")

    etc, pki = ctx.paths.etc, ctx.paths.pki
    changed = ""
    revoked = revoked_by_node_rm(ctx, etc / "agent.pem")
    if (etc / "agent.pem").exists() and not revoked:
        ctx.say("kept", f"agent certificate for {node}")
    else:
        if not (pki / "ca-key.pem").exists():
            raise PkiError(
                "the authority is not on this machine, so init cannot give it a node identity; "
                "onboard it from where the authority is, or pass --no-node"
            )
        CA.load(pki).issue_client(node).write(etc, "agent")
        shutil.copyfile(pki / "ca.pem", etc / "ca.pem")
        if revoked:
            ctx.say("updated", f"agent certificate for {node}: the old one was revoked by 'ctl node rm'")
            changed = "its certificate"
        else:
            ctx.say("done", f"agent certificate for {node}")

    conf = ctx.paths.agent_config
    agent_listen = ctx.config().agent_listen
    _h, port = parse_listen(agent_listen)
    server = f"https://{url_host(reachable_addr(ctx.opts.hosts))}:{port}"
    others = ha_servers(ctx.paths, agent_listen, server)
    if conf.exists():
        changed = reconcile_agent_yaml(ctx, conf) or changed
        changed = reconcile_control_planes(ctx, conf, [server, *others]) or changed
    else:
        files.write_atomic(
            conf,
            files.agent_yaml(
                server=server, node_id=node, etc=etc, label_key=plan.LOCAL_LABEL_KEY,
                label_value=plan.LOCAL_LABEL_VALUE, llama_server=ctx.opts.llama_server, servers=others,
                advertise=own_advertise(ctx.opts.hosts, others),
            ),
            0o644,
        )
        agentconf.record_binary(ctx.paths.state, ctx.opts.llama_server)
        ctx.say("done", f"{conf}" + (f" (control planes: {', '.join([server, *others])})" if others else ""))

    started = time.time()  # the store's clock (heartbeats' last_seen), not the waits' monotonic one
    kept = services.apply_service(ctx, "agent", agent_unit(ctx.paths, ctx.bin), "llmgw-agent", config_changed=changed)

    wait_node_ready(ctx, node, kept=kept, since=None if kept else started)
    return node


def own_advertise(hosts: list[str], others: list[str]) -> str:
    """Where this machine's engines bind and every gateway dials them: ``127.0.0.1`` on a
    single-machine install; on an HA cluster (``others``: the other control planes' agent URLs) the
    first ``--host``, this member's address (:func:`~llmgw.serverinit.steps.ha.prepare` puts it
    first), since the other control planes' gateways route to these engines too (a new user's HA
    node advertised loopback, which another machine's gateway would dial on itself).
    """
    return reachable_addr(hosts).strip("[]") if others else "127.0.0.1"


def revoked_by_node_rm(ctx: InitContext, cert: Path) -> bool:
    """True when the agent certificate ``cert`` is refused by the control plane (revoked, or issued
    before its node was removed with ``llmgw ctl node rm``): its agent would be refused and exit, and init would wait
    for it in vain. False when there is no certificate, or it does not load.

    Raises:
        ApiError, UnreachableError: the admin API did not answer the question (a 404 from a
            control plane without the route counts as "not revoked").
    """
    try:
        loaded = x509.load_pem_x509_certificate(cert.read_bytes())
    except (OSError, ValueError):
        return False
    serial = format(loaded.serial_number, "X")
    cns = loaded.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    node = str(cns[0].value) if cns else ""
    # As the agent API judges it: its serial revoked, or issued before its node's removal.
    issued_at = loaded.not_valid_before_utc.timestamp() + tlsconf.BACKDATE.total_seconds()
    try:
        return ctx.admin().revocation(serial, node=node, issued_at=issued_at) is not None
    except ApiError as e:
        if e.status == 404:  # a control plane from before the route: it cannot say
            return False
        raise


def _waited(engine: str) -> bool:
    """Whether init waits for ``engine`` on a node it sets up (:attr:`llmgw.catalog.EngineTraits.waited_by_init`)."""
    traits = engine_traits(engine)
    return traits is not None and traits.waited_by_init


def wait_node_ready(ctx: InitContext, node: str, *, kept: bool = False, since: float | None = None) -> None:
    """Wait until ``node`` is ready with a llama.cpp engine; stop at once when its llama.cpp
    failed. Registered is quick. Having an engine is not: the node may download and check its
    own llama.cpp, and a new machine is often busy with its own package updates first.

    ``since`` (unix seconds): when this run started the agent; the node counts as ready only after
    a heartbeat from then on. The store still says ``ready`` for a node (and its replicas) from
    before the agent stopped, and only the new agent's first heartbeat says what runs now
    (:meth:`~llmgw.control.store.base.Store.apply_reports`); believing the old state printed
    "kept … is serving" for an engine that ``service stop --engines`` had stopped.

    Raises:
        EngineError: llama.cpp failed or is unsupported on the node. WaitTimeout: not in time.
    """
    client = ctx.admin(PROBE_TIMEOUT_S)
    try:
        told = load_agent_config(ctx.paths.agent_config).server
    except ConfigError:
        told = "the server agent.yaml names"

    def ready() -> bool:
        try:
            nodes = client.nodes()
        except LlmgwError as e:
            ctx.note(f"the control plane does not answer: {e}")
            return False
        ctx.note(f"node {node} has not registered (its agent connects to {told}; "
                 "'llmgw service logs agent' says why not)")
        for n in nodes:
            if n.id != node:
                continue
            if since is not None and (n.last_seen or 0.0) < since:
                ctx.note(f"node {node}: waiting for its agent's first heartbeat since it was started")
                continue
            ctx.note(f"node {node} is {n.state}, no llama.cpp engine reported yet")
            if n.state == "ready" and any(_waited(e) for e in n.engines):
                return True
            for p in n.provision:
                line = f"{p.engine} {p.version}: {p.state} {p.detail}"
                ctx.progress(" ".join(line.split()))
                # Only llama.cpp is waited for (EngineTraits.waited_by_init): vLLM installs for
                # minutes after, and one this node cannot run is not a reason to stop here.
                if _waited(p.engine) and p.state in ("failed", "unsupported"):
                    raise EngineError(f"installing {p.engine} on this node: {p.detail}")
        return False

    first = True  # "kept" only when its agent ran as it was and the node was ready at once
    was_ready = False

    def probe() -> bool:
        nonlocal first, was_ready
        got = ready()
        was_ready, first = got and first, False
        return got

    ctx.wait(ctx.opts.node_wait_s, "this node to be ready with an engine", probe, interval_s=ctx.opts.poll_s)
    ctx.say("kept" if kept and was_ready else "done", f"node {node} is ready")


def reconcile_control_planes(ctx: InitContext, conf: Path, want: list[str]) -> str:
    """On an HA cluster, add the control planes agent.yaml does not name yet to its ``servers``
    (:func:`llmgw.serverinit.agentconf.add_servers`); returns ``"agent.yaml"`` when it changed, else
    ``""``. Nothing to do on a single machine (``want`` is this control plane alone).

    Raises:
        ConfigError: agent.yaml does not load (left as it is), or could not be changed (restored).
    """
    if len(want) < 2:
        return ""
    out = agentconf.add_servers(conf, want)
    if not out.added:
        return ""
    ctx.say("updated", f"{conf}: servers += {', '.join(out.added)} (every control plane of the HA cluster; "
                       f"the previous file is in {out.backup})")
    return "agent.yaml"


def reconcile_agent_yaml(ctx: InitContext, conf: Path) -> str:
    """Keep agent.yaml; when ``--llama-server`` differs from its binary and init wrote that
    value, update it (see :mod:`llmgw.serverinit.agentconf`). Returns what changed (``""`` when
    nothing did)."""
    new = ctx.opts.llama_server
    if new is None:
        ctx.say("kept", f"{conf}")
        return ""
    out = agentconf.reconcile_binary(conf, ctx.paths.state, new)
    if out.action == "kept":
        ctx.say("kept", f"{conf}")
        return ""
    if out.action == "updated":
        ctx.say(
            "updated",
            f"{conf}: engines.llamacpp.binary {out.old or '(not set)'} -> {new} (was written by init; "
            f"the previous file is in {out.backup})",
        )
        return "agent.yaml"
    why = (
        f"init wrote {out.recorded or '(not set)'} there and it was edited since"
        if out.known
        else "init has no record of writing it"
    )
    ctx.say(
        "!!",
        f"{conf} says engines.llamacpp.binary: {out.old or '(not set)'}, not --llama-server {new}; "
        f"{why}, so init leaves it: edit it and run 'llmgw service restart agent' to change",
    )
    return ""
