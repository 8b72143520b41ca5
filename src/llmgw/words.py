"""Counted nouns and lists of names for the sentences operators read (explanations, refusals).

``counted(1, "core")`` is ``1 core``, ``counted(2, "core")`` is ``2 cores``: a message never says
"needs 1 cores". :func:`names` joins ids the way a sentence does (``a, b and c``), keeping the first
few and counting the rest, so a line stays one line on a 5,000-node cluster.
"""

from __future__ import annotations

from collections.abc import Sequence


def plural(n: int, noun: str, many: str | None = None) -> str:
    """``noun`` when ``n`` is 1, else ``many`` (default: ``noun`` + ``s``)."""
    return noun if n == 1 else (many or f"{noun}s")


def counted(n: int, noun: str, many: str | None = None) -> str:
    """``1 core``, ``2 cores`` (``many``: the plural when it is not ``noun`` + ``s``)."""
    return f"{n} {plural(n, noun, many)}"


def names(items: Sequence[str], most: int = 3) -> str:
    """``a``, ``a and b``, ``a, b and c``; past ``most`` names: ``a, b, c and 4 more``; "" for none."""
    if not items:
        return ""
    if len(items) <= most:
        return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"
    return f"{', '.join(items[:most])} and {len(items) - most} more"
