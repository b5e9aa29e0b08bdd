"""One background thread that runs steps in the order they are handed over.

The writers use it for work that must not hold up the writing thread but must keep its order:
making written files durable (fsync, rename, resume records) and hashing a source file's bytes
as they stream past. A failing step is never lost: it is raised at the writing thread, at a
later hand-over or when the lane is settled.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable


class Lane:
    """Steps run one at a time, in order, on one thread; ``hold_limit`` bounds the bytes of data
    the queued steps keep alive (the caller waits at a hand-over once more would be held)."""

    def __init__(self, name: str, *, hold_limit: int | None = None):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.hold_limit = hold_limit
        self._pending: deque[tuple[Future[None], int]] = deque()
        self.held = 0

    def submit(self, fn: Callable[..., None], *args: Any, hold: int = 0) -> None:
        """Queue ``fn(*args)``, which keeps ``hold`` bytes alive until it has run.

        The step is queued first (what it was handed is the lane's from then on); then an earlier
        step's failure is raised here, and, over ``hold_limit``, the oldest steps are waited for.
        """
        self._pending.append((self._pool.submit(fn, *args), hold))
        self.held += hold
        while self._pending and (self._pending[0][0].done()
                                 or (self.hold_limit is not None and self.held > self.hold_limit)):
            self._pop()

    def settle(self, *, raise_errors: bool = True) -> None:
        """Wait for every queued step; raise the first failure (``raise_errors=False``: keep it, to be
        raised by a later call)."""
        for fut, _ in self._pending:
            fut.exception()  # waits
        if raise_errors:
            while self._pending:
                self._pop()

    def close(self, *, cancel: bool = False) -> None:
        """Stop the thread after the running step (and, unless ``cancel``, the queued ones)."""
        self._pool.shutdown(wait=True, cancel_futures=cancel)

    def _pop(self) -> None:
        fut, n = self._pending[0]
        fut.result()  # a failure stays at the front: raised again by the next settle
        self._pending.popleft()
        self.held -= n


__all__ = ["Lane"]
