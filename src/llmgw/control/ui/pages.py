"""What the dashboard's templates show, built from the admin API's views (pure functions).

Shapes: :class:`Bar` is one "used of total" gauge (percent 0-100 and a label with units);
:func:`node_bars` gives a node's cores, memory and per-GPU bars; :func:`replica_counts` counts
replicas by state; :func:`problems` gathers what an operator should look at (failed replicas, lost
nodes, engines that failed to install, GPU discovery problems, replicas placement cannot place);
:func:`usage_series` turns usage rows into one series per key for the plot.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

from llmgw.views import AutoscaleView, ModelView, NodeView, ReplicaView, UsageView

#: Bytes in a GB: the unit ``ctl nodes``, the catalog's ``min_memory_gb`` and placement's reasons use.
GB = 10**9
STATE_ORDER = ("ready", "starting", "pending", "failed", "stopping")


@dataclass(frozen=True)
class Bar:
    """A gauge: ``label`` (``"Memory"``), ``used``/``total`` in the unit ``text`` shows, ``pct`` 0-100."""

    label: str
    pct: int
    text: str


def _bar(label: str, used: float, total: float, unit: str, digits: int = 1) -> Bar:
    pct = 0 if total <= 0 else max(0, min(100, round(100 * used / total)))
    return Bar(label, pct, f"{used:.{digits}f} of {total:.{digits}f} {unit} reserved")


def node_bars(node: NodeView) -> list[Bar]:
    """Cores reserved of total, memory reserved of total (GB, as ``ctl nodes`` shows it), and each
    GPU's memory in use (GB, as discovery measured it)."""
    out = []
    res = node.resources
    if res is not None:
        out.append(_bar("Cores", res.cores_reserved, res.cores, "cores", 0))
        out.append(_bar("Memory", res.memory_reserved_bytes / GB, res.memory_total_bytes / GB, "GB"))
    for g in node.gpus:
        b = _bar(f"GPU {g.index} ({g.name})", g.memory_used_bytes / GB, g.memory_total_bytes / GB, "GB")
        out.append(Bar(b.label, b.pct, b.text.replace("reserved", "in use")))
    return out


def replica_counts(replicas: list[ReplicaView]) -> list[tuple[str, int]]:
    """``[(state, count)]``, the usual states first (ready, starting, pending, failed, stopping)."""
    counts = Counter(r.state for r in replicas)
    order = [s for s in STATE_ORDER if s in counts] + sorted(s for s in counts if s not in STATE_ORDER)
    return [(s, counts[s]) for s in order]


def wanted(model: ModelView) -> int:
    """Replicas a model wants: its ``scaling.min``."""
    return model.scaling_min


@dataclass(frozen=True)
class Problem:
    """Something to look at: ``what`` names it (a replica, node or model; a link target in ``href``)."""

    what: str
    href: str
    text: str


def problems(nodes: list[NodeView], replicas: list[ReplicaView], models: list[ModelView]) -> list[Problem]:
    """Failed replicas (their error), replicas that carry the error of the one they replaced,
    pending replicas (placement's reason), lost or unreachable nodes, failed engine installs, GPU
    discovery problems, and broken catalog entries; in that order."""
    out: list[Problem] = []
    for r in replicas:
        if r.state == "failed" or r.err:
            out.append(Problem(r.id, f"models/{r.model}", r.err or "failed"))
        elif r.last_error:
            out.append(Problem(r.id, f"models/{r.model}", f"replaced a replica that failed: {r.last_error}"))
    seen_pending: set[str] = set()
    for r in replicas:
        if r.state == "pending" and not r.node and r.model not in seen_pending:
            seen_pending.add(r.model)
            out.append(Problem(r.model, f"models/{r.model}", f"not placed: {r.pending_reason}"))
    for n in nodes:
        if n.state not in ("ready",):
            out.append(Problem(n.id, f"nodes/{n.id}", f"node is {n.state}"))
        for p in n.provision:
            if p.state == "failed":
                out.append(Problem(n.id, f"nodes/{n.id}", f"engine {p.engine} failed to install: {p.detail}"))
        out.extend(Problem(n.id, f"nodes/{n.id}", text) for text in n.problems)
    out.extend(Problem(m.name, f"models/{m.name}", f"cannot be read: {m.broken}") for m in models if m.broken)
    return out


def ago(ts: float | None, now: float | None = None) -> str:
    """``"12 s ago"``, ``"5 min ago"``, ``"3 h ago"``, ``"2 d ago"``; ``"never"`` for None."""
    if ts is None:
        return "never"
    s = max(0.0, (now or time.time()) - ts)
    if s < 90:
        return f"{s:.0f} s ago"
    if s < 5400:
        return f"{s / 60:.0f} min ago"
    if s < 172800:
        return f"{s / 3600:.0f} h ago"
    return f"{s / 86400:.0f} d ago"


def until(ts: float | None, now: float | None = None) -> str:
    """``"in 29 d"`` (the same steps as :func:`ago`), ``"past"`` when ``ts`` is over, ``"never"`` for None."""
    if ts is None:
        return "never"
    left = ts - (now or time.time())
    if left <= 0:
        return "past"
    return "in " + ago(0.0, left).removesuffix(" ago")


def usage_series(rows: list[UsageView], days: int, today: date | None = None) -> dict[str, object]:
    """The usage plot's data: ``{"days": [unix seconds at 00:00 UTC, …], "series": {key: [tokens per
    day, …]}}`` over the last ``days`` days (zeros where a key used nothing), tokens = prompt +
    completion, summed over models."""
    end = today or datetime.now(UTC).date()
    start = end - timedelta(days=days - 1)
    index = {(start + timedelta(days=i)).isoformat(): i for i in range(days)}
    series: dict[str, list[int]] = {}
    for r in rows:
        i = index.get(r.day)
        if i is None:
            continue
        series.setdefault(r.key, [0] * days)[i] += r.prompt_tokens + r.completion_tokens
    stamps = [int(datetime.combine(start + timedelta(days=i), datetime.min.time(), UTC).timestamp())
              for i in range(days)]
    return {"days": stamps, "series": dict(sorted(series.items()))}


def autoscale_series(view: AutoscaleView) -> dict[str, object]:
    """The autoscaling plot's data, in the usage plot's shape: ``{"days": [unix seconds, …],
    "series": {"wanted": […], "ready": […], "load": […]}}`` from the view's history (every 15 s,
    the last hour); ``load`` is requests in flight plus queued over every control plane."""
    h = view.history
    return {
        "days": [int(p.at) for p in h],
        "series": {
            "wanted": [p.wanted for p in h], "ready": [p.ready for p in h], "load": [round(p.load, 2) for p in h]
        },
    }

