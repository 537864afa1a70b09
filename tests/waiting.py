"""Waiting for an outcome with a deadline, instead of sleeping a guessed time."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def until(condition: Callable[[], bool], timeout: float = 5.0, poll: float = 0.01) -> None:
    """Return once ``condition()`` is true; fail with TimeoutError after ``timeout`` seconds."""
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(poll)


async def until_result(
    call: Callable[[], Awaitable[T]], accept: Callable[[T], bool], timeout: float = 5.0, poll: float = 0.05
) -> T:
    """Call ``call()`` until ``accept`` takes its result; return that result."""
    async with asyncio.timeout(timeout):
        while True:
            result = await call()
            if accept(result):
                return result
            await asyncio.sleep(poll)
