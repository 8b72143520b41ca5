"""``llmgw chat``: ask the gateway as any client would."""

from __future__ import annotations


def chat() -> None:
    """Ask the gateway (not yet wired)."""
