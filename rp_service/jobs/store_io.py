"""The store's own threads: one writer for the orchestrator, a few readers for catch-ups.

`asyncio.to_thread` shares one pool with every upload, page and probe of the daemon; a
burst of them queues the orchestrator's event writes behind them. Here the writes have a
thread of their own (SQLite takes one writer at a time anyway, and one thread keeps a
job's events committed and published in the order they were written), and the followers'
catch-up reads have a small pool that cannot hold up either the writes or the rest.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

from rp_service.jobs.store import Store

__all__ = ["StoreIO"]

T = TypeVar("T")


class StoreIO:
    """Runs blocking `Store` calls off the event loop, on threads kept for the store."""

    def __init__(self, store: Store, *, readers: int = 2) -> None:
        self.store = store
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="rp-store-write")
        self._readers = ThreadPoolExecutor(readers, thread_name_prefix="rp-store-read")

    async def write(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on the writer thread, after the writes submitted before it."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._writer, partial(fn, *args, **kwargs))

    async def read(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on a reader thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._readers, partial(fn, *args, **kwargs))

    def close(self) -> None:
        """Finish what was submitted and stop the threads; call before `Store.close`."""
        self._writer.shutdown(wait=True)
        self._readers.shutdown(wait=True)
