"""The one label a node cannot give itself: ``llmgw.control-plane`` (:data:`llmgw.names.CONTROL_PLANE_LABEL`).

``server init`` pins the starter model and the guard judges to the control plane's own machine with
that label, and a node's labels are what its agent reports. A node another party controls (its
certificate and key taken) claimed it in a heartbeat, with a large inventory, and the next replica of
the starter, and of a judge, which reads every guarded prompt of every model, was placed on it with
its key (a security tester's finding). As Kubernetes' NodeRestriction admission plugin keeps kubelets
from setting ``node-restriction.kubernetes.io/`` labels on themselves, the agent API honours the label
only from a node a control plane names as its own: the node of the ``agent.yaml`` on its machine,
published in its ``control_planes`` row (:meth:`~llmgw.control.reconcile.membership.Membership.own_nodes`,
read every few seconds). From any other node it is dropped before the heartbeat is stored, and logged
once per node per process. Installs made before it keep working: each control plane reads its
machine's ``agent.yaml`` (until it finds one: init writes it after starting the control plane).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from llmgw.config import load_agent_config
from llmgw.errors import ConfigError
from llmgw.names import CONTROL_PLANE_LABEL
from llmgw.paths import Paths
from llmgw.protocol import Heartbeat

log = logging.getLogger(__name__)


def honoured(
    node_id: str, hb: Heartbeat, own_nodes: Callable[[], frozenset[str]] | None, warned: set[str]
) -> Heartbeat:
    """``hb`` as it may be stored for ``node_id``: without :data:`~llmgw.names.CONTROL_PLANE_LABEL`
    unless ``own_nodes()`` (the control planes' own nodes; None: no node's) holds ``node_id``.
    ``warned``: the nodes already logged (one warning each)."""
    if CONTROL_PLANE_LABEL not in hb.labels or (own_nodes is not None and node_id in own_nodes()):
        return hb
    if node_id not in warned:
        warned.add(node_id)
        log.warning(
            "node %s: its agent claims the label %s, which only a control plane's own node carries; dropped "
            "(a node given it in its agent.yaml by hand: remove it there; otherwise this node's credentials "
            "may be in other hands: 'llmgw ctl node rm %s')", node_id, CONTROL_PLANE_LABEL, node_id,
        )
    labels = {k: v for k, v in hb.labels.items() if k != CONTROL_PLANE_LABEL}
    return hb.model_copy(update={"labels": labels})


def own_node(paths: Paths) -> str:
    """The node id of the ``agent.yaml`` on this machine (``paths.agent_config``), "" when there is
    none or it cannot be read (logged: its node then loses the control plane's label)."""
    if not paths.agent_config.exists():
        return ""
    try:
        return load_agent_config(paths.agent_config).node_id
    except ConfigError as e:  # the control plane serves on without it
        log.warning("%s cannot be read (%s): no node of this machine carries the label %s",
                    paths.agent_config, e, CONTROL_PLANE_LABEL)
        return ""
