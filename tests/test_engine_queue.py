"""The engine's one queue (engine_queue.py): arrival order across threads and coroutines, position
reports, a bounded line, and a place given up by a waiter that leaves."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import threading
import time

import pytest

from specchat.engine_queue import EngineQueue, QueueFull, Waiting


def test_tickets_hold_the_engine_in_arrival_order():
    queue = EngineQueue()
    a, b, c = queue.join(), queue.join(), queue.join()
    assert (a.ahead, b.ahead, c.ahead, queue.waiting) == (0, 1, 2, 2)
    b.leave()  # a waiter gives up its place: the ones behind move up
    assert (a.ahead, c.ahead, queue.waiting) == (0, 1, 1)
    a.leave()
    assert c.ahead == 0 and queue.waiting == 0
    a.leave()  # leaving twice changes nothing
    assert c.ahead == 0
    c.leave()
    assert queue.join().ahead == 0  # an empty line: the engine at once


def test_a_full_line_refuses_and_the_holder_does_not_count():
    queue = EngineQueue()
    queue.join(limit=1)  # holds the engine
    queue.join(limit=1)  # waits
    with pytest.raises(QueueFull) as full:
        queue.join(limit=1)
    assert full.value.waiting == 1
    assert queue.join().ahead == 2  # without a limit (the page's) it still joins


def test_each_engine_has_one_queue_which_goes_with_it():
    @dataclasses.dataclass
    class Engine:  # a dataclass: equal instances, no hash; each is its own engine still
        name: str = "tiny"

    one, other = Engine(), Engine()
    assert EngineQueue.of(one) is EngineQueue.of(one)
    assert EngineQueue.of(one) is not EngineQueue.of(other)
    key = id(one)
    del one
    gc.collect()
    assert key not in EngineQueue._queues


def test_a_thread_and_coroutines_are_served_in_the_order_they_came():
    """Coroutines wait holding no thread, a thread blocks with reports; the engine goes to
    each in turn as the one before leaves."""
    queue = EngineQueue()
    holder = queue.join()
    served: list[str] = []
    reports: list[str] = []

    async def request(name: str, ticket) -> None:
        await ticket.granted()
        served.append(name)
        await asyncio.sleep(0.01)
        ticket.leave()

    def page(ticket) -> None:
        for report in ticket.reports():
            reports.append(report.message())
        served.append("page")
        ticket.leave()

    async def main() -> None:
        first = asyncio.create_task(request("first", queue.join()))
        thread = threading.Thread(target=page, args=(queue.join(),))
        thread.start()
        last = asyncio.create_task(request("last", queue.join()))
        await asyncio.sleep(0.1)
        assert served == [] and queue.waiting == 3
        holder.leave()
        await asyncio.gather(first, last)
        await asyncio.to_thread(thread.join, 10)

    asyncio.run(main())
    assert served == ["first", "page", "last"]
    assert reports[0] == "Waiting for the model: 2 ahead of you."
    assert "Waiting for the model: 1 ahead of you." in reports and reports[-1] == ""
    assert queue.waiting == 0 and queue.join().ahead == 0


def test_a_coroutine_cancelled_while_waiting_gives_its_place_up():
    queue = EngineQueue()
    holder = queue.join()

    async def main() -> None:
        ticket = queue.join()

        async def wait() -> None:
            try:
                await ticket.granted()
            except asyncio.CancelledError:
                ticket.leave()  # what the API does when its client leaves
                raise

        task = asyncio.create_task(wait())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert queue.waiting == 0
    behind = queue.join()
    holder.leave()
    assert behind.ahead == 0


def test_a_stopped_page_reply_stops_waiting():
    queue = EngineQueue()
    queue.join()
    ticket, stop = queue.join(), threading.Event()
    threading.Timer(0.1, stop.set).start()
    started = time.monotonic()
    reports = list(ticket.reports(stop))
    assert time.monotonic() - started < 1.0  # no need to wait out the second
    assert reports[0] == Waiting(1) and reports[-1] == Waiting(0) and ticket.ahead == 1
