"""One queue per engine, in arrival order, for every reply that wants it: the page's and the API's.

    ticket = EngineQueue.of(engine).join()       # a place at the end of the line
    for report in ticket.reports(stop):          # the page: in a worker thread, as the line moves
        show(report.message())                   #   "Waiting for the model: 2 ahead of you."
    await ticket.granted()                       # the API: in the event loop, holding no thread
    ...                                          # generate: the engine is this ticket's
    ticket.leave()                               # the next in line gets it at once

The engine generates one reply at a time. The page's replies run in gradio's worker threads and
may block there; the API's requests wait as coroutines, because a few requests blocked in the
event loop's executor would take every thread it has, and the reply holding the engine could
never get one to continue (the whole server hung). A ticket serves both: the line is a list under
one lock, its first ticket holds the engine, and every change wakes the waiting tickets (a
condition for threads, a future set through `call_soon_threadsafe` for coroutines), so each
knows its place at once and replies are served in the order they asked. `join(limit)` raises
QueueFull when `limit` tickets wait already: how the API bounds the line.

The queue belongs to the engine, the way its lock does; `EngineQueue.of(engine)` finds it, so the
page and the API share it without either knowing of the other.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass


class QueueFull(Exception):
    """`join(limit)` found `limit` tickets waiting already."""

    def __init__(self, waiting: int):
        super().__init__(f"{waiting} replies are waiting for the engine")
        self.waiting = waiting


@dataclass
class Waiting:
    """A reply still waiting for the engine: how many replies are ahead of it (0: its turn)."""
    ahead: int

    def message(self) -> str:
        if not self.ahead:
            return ""
        return f"Waiting for the model: {self.ahead} ahead of you."


class Ticket:
    """A place in an `EngineQueue`. `leave` may be called from any thread, more than once."""

    def __init__(self, queue: EngineQueue):
        self.queue = queue
        self._wake = None  # a waiting coroutine's wake-up, called on every change of the line

    @property
    def ahead(self) -> int:
        """Replies before this one, the one generating included (0: the engine is ours)."""
        with self.queue._changed:
            return self.queue._ahead(self)

    def wait(self, timeout: float | None = None) -> int:
        """Block until the engine is ours or the line moves, at most `timeout` seconds;
        returns `ahead`."""
        with self.queue._changed:
            before = self.queue._ahead(self)
            if before:
                self.queue._changed.wait_for(lambda: self.queue._ahead(self) != before,
                                             timeout)
            return self.queue._ahead(self)

    def reports(self, stop: threading.Event | None = None) -> Iterator[Waiting]:
        """For a thread that waits: a report each time the line moves (and every quarter second,
        so `stop` is seen soon), until the engine is ours or `stop` is set; Waiting(0) last when it
        waited at all. Afterwards `ahead` is 0 unless it was stopped."""
        ahead = waited = self.ahead
        while ahead and not (stop is not None and stop.is_set()):
            yield Waiting(ahead)
            ahead = self.wait(0.25)
        if waited:
            yield Waiting(0)

    async def granted(self) -> None:
        """Wait, as a coroutine, until the engine is ours. Cancelled, the caller leaves."""
        loop = asyncio.get_running_loop()
        while True:
            moved = loop.create_future()
            with self.queue._changed:
                if not self.queue._ahead(self):
                    self._wake = None
                    return
                self._wake = lambda: loop.call_soon_threadsafe(_settle, moved)
            await moved

    def leave(self) -> None:
        """Out of the line; the engine, if it was ours, goes to the next ticket."""
        self.queue._leave(self)

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *exc) -> None:
        self.leave()


def _settle(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class EngineQueue:
    """The tickets of one engine: the first holds it, the others wait in arrival order."""

    _queues: dict[int, EngineQueue] = {}  # id(engine) -> its queue, while the engine lives
    _queues_lock = threading.Lock()

    def __init__(self):
        self._changed = threading.Condition()
        self._line: list[Ticket] = []

    @classmethod
    def of(cls, engine) -> EngineQueue:
        """The queue of `engine`, made on first use and dropped with the engine (any object:
        engines need not be hashable)."""
        with cls._queues_lock:
            queue = cls._queues.get(id(engine))
            if queue is None:
                queue = cls._queues[id(engine)] = cls()
                try:
                    weakref.finalize(engine, cls._queues.pop, id(engine), None)
                except TypeError:  # an object without weak references lives as long anyway
                    pass
            return queue

    @property
    def waiting(self) -> int:
        """Tickets waiting, not counting the one that holds the engine."""
        with self._changed:
            return max(len(self._line) - 1, 0)

    def join(self, limit: int | None = None) -> Ticket:
        """A ticket at the end of the line (the engine at once when the line is empty).
        Raises QueueFull when `limit` tickets wait already."""
        ticket = Ticket(self)
        with self._changed:
            waiting = max(len(self._line) - 1, 0)
            if limit is not None and self._line and waiting >= limit:
                raise QueueFull(waiting)
            self._line.append(ticket)
        return ticket

    def _ahead(self, ticket: Ticket) -> int:
        try:
            return self._line.index(ticket)
        except ValueError:  # left already: nothing to wait for
            return 0

    def _leave(self, ticket: Ticket) -> None:
        with self._changed:
            if ticket not in self._line:
                return
            self._line.remove(ticket)
            self._changed.notify_all()
            wakes = [t._wake for t in self._line if t._wake is not None]
        for wake in wakes:  # outside the lock: a wake-up only schedules work on its loop
            try:
                wake()
            except RuntimeError:  # its loop has closed; the ticket's owner is gone
                pass
