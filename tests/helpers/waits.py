"""Waiting in async tests for a condition that real processes make true."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any


async def until(what: str, pred: Callable[[], Awaitable[Any]], within_s: float = 20, every_s: float = 0.1) -> Any:
    """Await ``pred()`` every ``every_s`` seconds until it returns something truthy, and return that;
    an AssertionError naming ``what`` after ``within_s`` seconds."""

    async def poll() -> Any:
        while True:
            got = await pred()
            if got:
                return got
            await asyncio.sleep(every_s)

    try:
        return await asyncio.wait_for(poll(), within_s)
    except TimeoutError:
        raise AssertionError(f"not within {within_s} s: {what}") from None
