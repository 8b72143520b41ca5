"""Waiting for something with a deadline, as the seed's ``waitFor`` does.

``server init`` never waits silently for ten minutes: each wait has a deadline, the probe prints
its own progress lines, and the message on giving up says what was awaited and that running init
again keeps waiting. The clock and the sleep are injected so tests do not sleep.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from llmgw.errors import WaitTimeout


@dataclass
class Clock:
    """Monotonic time and sleep (seconds); tests pass a fake that advances on ``sleep``."""

    now: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep


def format_duration(seconds: float) -> str:
    """``90`` → ``1m30s``, ``1200`` → ``20m0s``, ``30`` → ``30s`` (the seed prints Go durations)."""
    s = round(seconds)
    return f"{s // 60}m{s % 60}s" if s >= 60 else f"{s}s"


def wait_for(
    limit_s: float, what: str, done: Callable[[], bool], *, interval_s: float = 0.5, clock: Clock | None = None
) -> None:
    """Poll ``done`` until it returns True, raises, or ``limit_s`` seconds pass.

    ``done`` raising (an :class:`~llmgw.errors.LlmgwError`) ends the wait with that error: a probe
    that knows the answer is "never" says so at once.

    Raises:
        WaitTimeout: "gave up waiting for <what> after <limit>; run init again to keep waiting".
    """
    clock = clock or Clock()
    deadline = clock.now() + limit_s
    while True:
        if done():
            return
        if clock.now() >= deadline:
            raise WaitTimeout(
                f"gave up waiting for {what} after {format_duration(limit_s)}; run init again to keep waiting"
            )
        clock.sleep(interval_s)
