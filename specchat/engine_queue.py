"""One line per engine for every reply that wants it, the page's and the API's, served fairly:
round-robin over owners (a login, an API key, a browser), each owner's own replies in the order
it asked.

    ticket = EngineQueue.of(engine).join(owner=owner)   # a place in the line
    for report in ticket.reports(stop):          # the page: in a worker thread, as the line moves
        show(report.message())                   #   "Waiting for the model: 2 ahead of you
                                                 #    (about 20 s)."
    await ticket.granted()                       # the API: in the event loop, holding no thread
    ...                                          # generate: the engine is this ticket's
    ticket.leave()                               # the next in line gets it at once

The engine generates one reply at a time. The page's replies run in gradio's worker threads and
may block there; the API's requests wait as coroutines, because a few requests blocked in the
event loop's executor would take every thread it has, and the reply holding the engine could
never get one to continue (the whole server hung). A ticket serves both: the line is a list under
one lock, its first ticket holds the engine, and every change wakes the waiting tickets (a
condition for threads, a future set through `call_soon_threadsafe` for coroutines), so each
knows its place at once. `join(limit, per_owner=n)` raises QueueFull when `n` of this owner's
tickets wait already while another owner's wait too, or when `limit` tickets wait and this owner
has one of them: how every route bounds one owner's share of the line and the line itself. A
lone owner's batch (a client's eight parallel requests, nobody else there) waits its turn. An owner with nothing waiting
always gets a place, so no number of other owners' replies shuts a visitor out; the line holds
at most `limit` tickets plus one for each other owner.

**Fair, not first come first served.** When the engine comes free it goes to the next owner
in the rotation that has a reply waiting, who then moves to the rotation's end: with owners A
(five replies waiting), B and C (one each), the order is A, B, C, A, A, A, A, and an owner
who floods the line delays each other owner by one of its replies at most per round. A
ticket's place (`ahead`) is its place in that order, and its expected wait is that many
replies at the average time the engine was held lately.

The queue belongs to the engine, the way its lock does; `EngineQueue.of(engine)` finds it, so the
page and the API share it without either knowing of the other.

**The engine never waits for its reader.** Once a ticket holds the engine, `run_reply` runs the
reply apart from its reader and hands each item on as it comes: to an asyncio queue for the
API (through a `LoopPost`, which wakes the event loop at most every `POST_S`), to a `Mailbox`
for the page, whose generator wakes when it chooses (every repaint), takes
everything that came and repaints once. A slow browser or a slow repaint drops frames, never
tokens and never engine time. The ticket is left when the reply ends, so the next in line goes
on at once; a Stop (the reply's event) still ends it at the next step boundary.

**Replies run on the main thread where a server lets it (`EngineLoop`).** The kernels' parallel
loops are OpenMP's (libgomp): a loop started from any thread but the process's first, with as
many workers as the machine has cores, makes libgomp count more threads than cores and throttle
its workers' waits, so every product of a step pays a wake-up (measured on 2 cores: the
embedded target's NF4 product of one token 36 µs from the main thread, 76 µs from another; a
whole reply 88 against 56 tok/s). So `python app.py` and `serve` run their servers in threads
and give the main thread to an `EngineLoop`, which runs every reply, one after another, in the
order the line grants them. Without a loop (tests, a server embedded elsewhere) a reply runs in
a thread of its own.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import weakref
from concurrent.futures import Future
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field


# The limits every route joins the line with (the page's replies, the page's `generate`
# endpoint and the HTTP API): past MAX_WAITING waiting, an owner with a reply waiting already
# is refused; while other owners wait, no owner may have more than MAX_PER_OWNER waiting.
MAX_WAITING = 8
MAX_PER_OWNER = 2


class QueueFull(Exception):
    """`join` found `limit` tickets waiting already, one of them this owner's (`mine` False),
    or `per_owner` of this owner's (`mine` True)."""

    def __init__(self, waiting: int, mine: bool = False):
        super().__init__(f"{waiting} of your replies are waiting already" if mine
                         else f"{waiting} replies are waiting for the engine")
        self.waiting, self.mine = waiting, mine


@dataclass
class Waiting:
    """A reply still waiting for the engine: how many replies are ahead of it (0: its turn),
    and about how many seconds that is (None until a reply has held the engine)."""
    ahead: int
    seconds: float | None = field(default=None, compare=False)

    def message(self) -> str:
        if not self.ahead:
            return ""
        wait = f" (about {_duration(self.seconds)})" if self.seconds is not None else ""
        return f"Waiting for the model: {self.ahead} ahead of you{wait}."


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{max(1, round(seconds))} s"
    return f"{round(seconds / 60)} min"


class Ticket:
    """A place in an `EngineQueue`. `leave` may be called from any thread, more than once."""

    def __init__(self, queue: EngineQueue, owner: str = ""):
        self.queue = queue
        self.owner = owner
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
            yield Waiting(ahead, self.queue.expected_wait(ahead))
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
    """The tickets of one engine: one holds it, the others wait their owner's turn."""

    _queues: dict[int, EngineQueue] = {}  # id(engine) -> its queue, while the engine lives
    _queues_lock = threading.Lock()
    HELD_WEIGHT = 0.3  # weight of the latest hold in the average hold time

    def __init__(self, clock=time.monotonic):
        self._changed = threading.Condition()
        self._holder: Ticket | None = None
        self._held_since = 0.0
        # owner -> its waiting tickets in the order it asked; the owners in rotation order
        self._owners: OrderedDict[str, deque[Ticket]] = OrderedDict()
        self._held_s: float | None = None  # average seconds the engine was held lately
        self.clock = clock

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
            return self._waiting()

    def expected_wait(self, ahead: int) -> float | None:
        """About how long `ahead` replies take, at the average hold time lately."""
        return None if self._held_s is None else ahead * self._held_s

    def join(self, limit: int | None = None, owner: str = "",
             per_owner: int | None = None) -> Ticket:
        """A ticket in the line for `owner` (the engine at once when no one holds it). Raises
        QueueFull when `per_owner` of this owner's tickets wait already and another owner's
        wait too, or `limit` tickets wait and one of them is this owner's (an owner with none
        waiting always joins)."""
        ticket = Ticket(self, owner)
        with self._changed:
            if self._holder is None:
                self._holder, self._held_since = ticket, self.clock()
                return ticket
            waiting = self._waiting()
            mine = self._owners.get(owner)
            if limit is not None and waiting >= limit and mine:
                raise QueueFull(waiting)
            crowded = len(self._owners) > (1 if mine else 0)  # another owner waits
            if per_owner is not None and mine and len(mine) >= per_owner and crowded:
                raise QueueFull(len(mine), mine=True)
            self._owners.setdefault(owner, deque()).append(ticket)
        return ticket

    @property
    def _line(self) -> list[Ticket]:
        """The holder, then the waiting tickets in the order they will be served: one of each
        owner's in rotation order, round after round."""
        line = [self._holder] if self._holder is not None else []
        queues = list(self._owners.values())
        for round_ in range(max((len(q) for q in queues), default=0)):
            line.extend(q[round_] for q in queues if round_ < len(q))
        return line

    def _waiting(self) -> int:
        return sum(len(q) for q in self._owners.values())

    def _ahead(self, ticket: Ticket) -> int:
        try:
            return self._line.index(ticket)
        except ValueError:  # left already: nothing to wait for
            return 0

    def _leave(self, ticket: Ticket) -> None:
        with self._changed:
            if ticket is self._holder:
                held = self.clock() - self._held_since
                self._held_s = held if self._held_s is None else \
                    self.HELD_WEIGHT * held + (1 - self.HELD_WEIGHT) * self._held_s
                self._holder = None
                if self._owners:  # the next owner in the rotation, then to its end
                    owner, mine = next(iter(self._owners.items()))
                    self._holder, self._held_since = mine.popleft(), self.clock()
                    del self._owners[owner]
                    if mine:
                        self._owners[owner] = mine
            else:
                mine = self._owners.get(ticket.owner)
                if mine is None or ticket not in mine:
                    return
                mine.remove(ticket)
                if not mine:
                    del self._owners[ticket.owner]
            self._changed.notify_all()
            wakes = [t._wake for t in self._line if t._wake is not None]
        for wake in wakes:  # outside the lock: a wake-up only schedules work on its loop
            try:
                wake()
            except RuntimeError:  # its loop has closed; the ticket's owner is gone
                pass


class Finished:
    """The last item a reply's thread hands on (`run_reply`)."""


class EngineLoop:
    """The thread that runs a server's replies: the main thread, given to `run` once the
    servers run in threads of their own (see the module's docstring for why). Jobs run one
    after another in the order they are submitted."""

    _current: EngineLoop | None = None
    _current_lock = threading.Lock()

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = threading.Event()

    @classmethod
    def current(cls) -> EngineLoop | None:
        """The loop running now, if any."""
        return cls._current

    def run(self, stop: threading.Event | None = None) -> None:
        """Run submitted jobs on this thread until `stop` (or `self.stop()`) is set or Ctrl+C
        (KeyboardInterrupt, raised here after the loop is gone)."""
        with EngineLoop._current_lock:
            if EngineLoop._current is not None:
                raise RuntimeError("an engine loop is running already")
            EngineLoop._current = self
        try:
            while not self._stopped.is_set() and not (stop is not None and stop.is_set()):
                try:
                    job = self._jobs.get(timeout=0.2)
                except queue.Empty:
                    continue
                job()
        finally:
            with EngineLoop._current_lock:
                EngineLoop._current = None
            while True:  # jobs that came too late run where they were asked
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                threading.Thread(target=job, name="specchat-reply", daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def call(self, function: Callable, *args):
        """`function(*args)` run on the loop's thread; waits for it and returns its result
        (or raises its exception)."""
        done: Future = Future()

        def job() -> None:
            try:
                done.set_result(function(*args))
            except BaseException as e:  # noqa: BLE001 - raised in the caller
                done.set_exception(e)

        self.submit(job)
        return done.result()


def run_reply(ticket: Ticket, produce: Callable[[], Iterable], put: Callable[[object], None],
              name: str = "specchat-reply") -> None:
    """Run one reply while `ticket` holds the engine, on the running `EngineLoop` or else in
    a thread of its own: each item of `produce()` goes to `put` as it is made, then the
    exception it raised (if any), then `Finished()`. The ticket is left when the reply ends, so
    the next in line goes on at once; if the reply cannot start, it is left at once and the
    error raised."""
    def reply() -> None:
        try:
            for item in produce():
                put(item)
        except Exception as e:  # noqa: BLE001 - handed to the reader, which answers it
            put(e)
        finally:
            ticket.leave()
            put(Finished())

    loop = EngineLoop.current()
    if loop is not None:
        loop.submit(reply)
        return
    try:
        threading.Thread(target=reply, name=name, daemon=True).start()
    except BaseException:
        ticket.leave()
        raise


class Mailbox:
    """Where a reply's thread puts its items for a reader that wakes on its own schedule: `put`
    never blocks and wakes the reader only for `Finished`; `take(timeout)` waits at most
    `timeout` seconds (less once the reply has finished) and returns every item that came."""

    def __init__(self):
        self._items: deque = deque()
        self._finished = False
        self._changed = threading.Condition()

    def put(self, item) -> None:
        with self._changed:
            self._items.append(item)
            if isinstance(item, Finished):
                self._finished = True
                self._changed.notify_all()

    def take(self, timeout: float) -> list:
        with self._changed:
            if not self._finished and timeout > 0:
                self._changed.wait_for(lambda: self._finished, timeout)
            items = list(self._items)
            self._items.clear()
            return items


POST_S = 0.025  # the least time between two wakes of an event loop by a reply's items


class LoopPost:
    """Where a reply's thread puts its items for an asyncio queue read in `loop`: the first
    item, an exception and `Finished` are handed over at once, the others together with what
    came since the last hand-over once `interval` seconds have passed (at most one engine step
    late). Each hand-over wakes the event loop, and a wake a token (its thread taking the GIL
    and a core from the engine) cost a streamed reply a few percent of its speed on 2 cores."""

    def __init__(self, loop, queue, interval: float = POST_S):
        self.loop, self.queue, self.interval = loop, queue, interval
        self._pending: list = []
        self._last: float | None = None

    def put(self, item) -> None:
        self._pending.append(item)
        now = time.perf_counter()
        if self._last is None or isinstance(item, (Finished, Exception)) \
                or now - self._last >= self.interval:
            batch, self._pending, self._last = self._pending, [], now
            self.loop.call_soon_threadsafe(self._deliver, batch)

    def _deliver(self, batch: list) -> None:
        for item in batch:
            self.queue.put_nowait(item)
