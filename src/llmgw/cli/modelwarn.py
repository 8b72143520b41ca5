"""What ``llmgw ctl model add`` warns about once the model is in the catalog (``!!`` lines on
stderr, the exit code stays 0: the add succeeded): a source the control plane cannot read, and a
model that fits on no node now (its replica stays pending; ``ctl explain-placement`` says why).
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

from llmgw.errors import LlmgwError

if TYPE_CHECKING:
    from llmgw.adminclient import AdminClient

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
              "(check the source against 'llmgw mirror ls'; fix it with 'llmgw ctl model rm' and add again)",
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
    why = "; ".join(f"{n['node']}: {n.get('reason') or n.get('kind')}" for n in misses[:3])
    why += f"; {len(misses) - 3} more" if len(misses) > 3 else ""
    those = "its replica stays" if wanted == 1 else "its replicas stay"
    print(f"!! {name} fits on no node now ({why or 'no node has joined the cluster'}); {those} pending until a node "
          f"has room: see 'llmgw ctl explain-placement {name}'", file=sys.stderr)
