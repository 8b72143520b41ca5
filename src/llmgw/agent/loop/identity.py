"""The node's identity on the agent API: its mTLS client context from agent.yaml's ``tls`` files
(``server add-node`` issues them), checked the same way by the agent's start and by ``llmgw
service restart agent`` before it stops the running agent."""

from __future__ import annotations

import ssl

from llmgw.config import AgentConfig
from llmgw.errors import PkiError
from llmgw.tlsconf import client_context, missing_files


def agent_tls(cfg: AgentConfig) -> ssl.SSLContext:
    """The agent's mTLS client context from ``cfg.tls`` (what ``service restart agent`` checks first).

    Raises:
        PkiError: a file is missing (named, with its agent.yaml key) or the CA, certificate or key
            cannot be loaded.
    """
    issue = (f"issue this node a certificate with 'llmgw server add-node {cfg.node_id} --address ADDR --out DIR' "
             "on the control plane and copy DIR's files beside agent.yaml")
    if gone := missing_files({"tls.ca": cfg.tls.ca, "tls.cert": cfg.tls.cert, "tls.key": cfg.tls.key}):
        raise PkiError(f"agent.yaml: {gone}; fix the path in agent.yaml, or {issue}")
    try:
        return client_context(cfg.tls.ca, cfg.tls.cert, cfg.tls.key)
    except (OSError, ssl.SSLError) as e:
        raise PkiError(
            f"agent.yaml: tls ({cfg.tls.ca}, {cfg.tls.cert}, {cfg.tls.key}) cannot be loaded: {e}; {issue}"
        ) from e
