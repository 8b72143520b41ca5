"""What ``llmgw ctl`` warns about once a change is made (``!!`` lines on stderr, the exit code stays
0: the change succeeded): after ``model add``, a source the control plane cannot read and a model
that fits on no node now (its replica stays pending; ``ctl explain-placement`` says why); after
``model set-profiles``, new profiles that no node can take whatever runs there; after ``model scale``,
more replicas than any node has room for now; after ``node drain``,
a model whose drained replicas no other node can take now.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

from llmgw.errors import LlmgwError

if TYPE_CHECKING:
    from llmgw.adminclient import AdminClient
    from llmgw.views import ReplicaView

#: Seconds ``ctl model add`` waits for the leader to read the new model's GGUF header (it does at
#: the pass the add wakes, within about a second) before it stops looking.
SOURCE_CHECK_S = 5.0


def warn_unreadable_source(client: AdminClient, name: str) -> dict[str, Any] | None:
    """Say on stderr when the control plane cannot read the GGUF header of ``name``'s source (a 404,
    a file that is not GGUF, a mirror that does not answer): its replicas would fail to start. The
    model stays added (the file may be carried in next); a typo shows here, not as a failed replica.
    Only a profile without ``min_memory_gb`` has its header read (for the estimate), so only then is
    there something to wait for (:data:`SOURCE_CHECK_S` at most). Returns the last
    ``GET …/resources`` answer, None when it could not be read."""
    deadline = time.monotonic() + SOURCE_CHECK_S
    error = ""
    try:
        while True:
            got = client.model_resources(name)
            error = got.get("facts_error") or ""
            waiting = got.get("facts") is None and any(p.get("memory_from") == "unknown" for p in got["profiles"])
            if error or not waiting or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    except LlmgwError:
        return None  # the add itself worked; the check is a courtesy
    if error:
        print(f"!! {name}: its source cannot be read as a GGUF file: {error}. Its replicas will fail until it can "
              f"(check the source against 'llmgw mirror ls'; fix it with 'llmgw ctl model set {name} source=URL')",
              file=sys.stderr)
    return got


def warn_fits_nowhere(client: AdminClient, name: str, resources: dict[str, Any], *, wanted: int) -> None:
    """Say on stderr when no node could take a replica of the model just added, with why and what to
    run: ``ctl model add`` printed ``added …`` alone and the model then waited, pending, unnoticed.

    From answers already there, nothing waited for: ``resources`` (placement's own checks of one
    more replica against every node now, :mod:`llmgw.control.placement.resources`), then the
    model's placed replicas. The leader places asynchronously (the add only wakes it), and a
    replica it placed already holds its room, so "no node fits one more" says "fits nowhere" only
    when none is placed: the replicas are asked second, so one placed in between is seen. A group
    profile counts as fitting when one node could be a member (no warning rather than a wrong one).
    """
    profiles = resources.get("profiles") or []
    if wanted < 1 or any(n.get("fits") for p in profiles for n in p.get("nodes", [])):
        return
    try:
        if any(r.node for r in client.replicas(name)):
            return
    except LlmgwError:
        return  # the add itself worked; the check is a courtesy
    misses = profiles[0].get("nodes", []) if profiles else []
    why = _reasons(misses)
    those = "its replica stays" if wanted == 1 else "its replicas stay"
    print(f"!! {name} fits on no node now ({why or 'no node has joined the cluster'}); {those} pending until a node "
          f"has room: see 'llmgw ctl explain-placement {name}'", file=sys.stderr)


def warn_scaled_past_room(client: AdminClient, name: str, n: int) -> None:
    """After ``model scale NAME N``: say on stderr when N is more replicas than the model has placed
    and no node could take one more now, with why: ``scale`` printed ``scaling 2..2`` alone while
    the second replica stayed pending (an operator's finding; ``model add`` and ``set-profiles`` said
    so). Placement's own check of one more replica against every node (``GET …/resources``); when
    one node has room for one, nothing is said (no warning rather than a wrong one)."""
    try:
        placed = sum(1 for r in client.replicas(name) if r.node)
        if n <= placed:
            return
        profiles = client.model_resources(name).get("profiles") or []
    except LlmgwError:
        return  # the change itself worked; the check is a courtesy
    if any(node.get("fits") for p in profiles for node in p.get("nodes", [])):
        return
    why = _reasons(profiles[0].get("nodes", []) if profiles else []) or "no node has joined the cluster"
    print(f"!! {name}: {placed} of {n} replicas placed, and no node can take another now ({why}); the rest "
          f"stay pending until a node has room: see 'llmgw ctl explain-placement {name}'", file=sys.stderr)


def warn_profiles_fit_no_node(client: AdminClient, name: str) -> None:
    """After ``model set-profiles``: say on stderr when no node could take a replica on any of the
    model's new profiles *whatever runs there*: every node's verdict for every profile is a rule
    (``filtered``: its state, a selector, the engine or GPU class, a node or card too small), none a
    resource held now (``exhausted``). A profile change restarts the model's replicas (the leader
    replaces each whose profile changed), so room its own replicas hold now may be free for their
    replacements: such a verdict says nothing, and no warning rather than a wrong one. A new
    user's profile asking more memory than any node has got a plain ``profiles set`` while the
    model then served nothing. Nothing is said when no node has joined (nothing changed there)."""
    try:
        profiles = client.model_resources(name).get("profiles") or []
    except LlmgwError:
        return  # the change itself worked; the check is a courtesy
    verdicts = [n for p in profiles for n in p.get("nodes", [])]
    if not verdicts or any(n.get("fits") or n.get("kind") != "filtered" for n in verdicts):
        return
    why = _reasons(profiles[0].get("nodes", []))
    print(f"!! {name}: its profiles fit on no node ({why}); its replicas stay pending until a profile or a node "
          f"changes: see 'llmgw ctl explain-placement {name}'", file=sys.stderr)


def warn_drained_nowhere(client: AdminClient, node: str, before: list[ReplicaView], *, removed: bool = False) -> None:
    """After ``node`` was drained: for each model that had replicas there (``before``: every replica
    as listed just before the drain), say on stderr when no other node could take one of them now
    (placement's own check of one more replica, as :func:`warn_fits_nowhere`), and how many of its
    replicas are still ready elsewhere. A drain stops the replicas at once and places their
    replacements where they fit; a new user drained the only node of a model and got a plain
    ``cordoned and drained`` while the model served nothing until the node was uncordoned."""
    # a removed node cannot be uncordoned: it re-joins with a new certificate (a new user's finding)
    back = (f"'llmgw server add-node {node}' re-joins it" if removed
            else f"'llmgw ctl node uncordon {node}' brings it back")
    for model in sorted({r.model for r in before if r.node == node}):
        try:
            profiles = client.model_resources(model).get("profiles") or []
        except LlmgwError:
            continue  # the drain itself worked; the check is a courtesy
        if any(n.get("fits") for p in profiles for n in p.get("nodes", [])):
            continue
        left = sum(1 for r in before if r.model == model and r.node not in ("", node) and r.state == "ready")
        misses = [n for n in (profiles[0].get("nodes", []) if profiles else []) if n.get("node") != node]
        why = _reasons(misses, more=False) or "no other node"
        print(f"!! {model}: no other node can take the replicas drained from {node} now ({why}); "
              f"{left} of its replicas {'is' if left == 1 else 'are'} ready elsewhere. They are placed when a "
              f"node has room ({back}): see 'llmgw ctl explain-placement {model}'", file=sys.stderr)


def _reasons(misses: list[dict[str, Any]], *, more: bool = True) -> str:
    """The first three nodes' verdicts from ``GET …/resources`` as ``node: reason; …`` (and how many
    more when ``more``)."""
    why = "; ".join(f"{n['node']}: {n.get('reason') or n.get('kind')}" for n in misses[:3])
    return why + (f"; {len(misses) - 3} more" if more and len(misses) > 3 else "")


def warn_judge_removed(client: AdminClient, name: str, aliases: list[str]) -> None:
    """After ``model rm``: say on stderr which guard policies judged with the removed model (by
    ``name`` or one of its ``aliases``) and now have no other judge with a ready replica: a
    ``fail: closed`` one refuses every request it guards, a ``fail: open`` one serves them unjudged.
    The admin API refuses ``scaling.min: 0`` for such a judge, but its removal said nothing (a new
    user's finding)."""
    try:
        policies = client.guard_status().get("policies") or []
    except LlmgwError:
        return  # the removal itself worked; the check is a courtesy
    gone = {name, *aliases}
    for p in policies:
        judges = p.get("judges") or []
        if not gone & {j.get("name") for j in judges}:
            continue
        if any(j.get("replicas_ready") and j.get("name") not in gone for j in judges):
            continue
        effect = ("refuses every request it guards (503 judge_unavailable)" if p.get("fail") == "closed"
                  else "serves the requests it guards unjudged")
        print(f"!! guard policy '{p.get('name')}' judged with {name} and has no other judge ready: it now {effect}; "
              f"add a judge ('llmgw ctl guard judge enable') or change the policy in server.yaml", file=sys.stderr)
