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


def test_owners_are_served_round_robin_each_in_the_order_it_asked():
    """A flood of one owner's replies delays every other owner by one of its replies a round
    at most; each owner's own replies keep their order."""
    queue = EngineQueue()
    holder = queue.join(owner="flood")
    flood = [queue.join(owner="flood") for _ in range(4)]
    alice, bob = queue.join(owner="alice"), queue.join(owner="bob")
    alice2 = queue.join(owner="alice")
    # in line: flood, alice, bob, then flood, alice, then the flood's last three
    assert [t.ahead for t in (flood[0], alice, bob, flood[1], alice2)] == [1, 2, 3, 4, 5]
    served = []
    holder.leave()
    while queue.waiting or queue._holder is not None:
        current = queue._holder
        served.append(("flood", flood.index(current)) if current in flood
                      else ("alice2" if current is alice2 else
                            "alice" if current is alice else "bob"))
        current.leave()
    assert served == [("flood", 0), "alice", "bob", ("flood", 1), "alice2", ("flood", 2),
                      ("flood", 3)]


def test_one_owner_may_hold_only_so_many_places_while_others_wait_and_is_told_which_limit():
    queue = EngineQueue()
    queue.join(owner="a")  # holds the engine: not a waiting place
    queue.join(owner="b", per_owner=2)  # another owner waits: the cap binds
    queue.join(owner="a", per_owner=2)
    queue.join(owner="a", per_owner=2)
    with pytest.raises(QueueFull) as full:
        queue.join(owner="a", per_owner=2)
    assert full.value.mine and full.value.waiting == 2
    assert "of your replies" in str(full.value)
    assert queue.join(owner="c", per_owner=2).ahead == 3  # its turn comes in the first round


def test_a_lone_owners_batch_waits_its_turn_up_to_the_lines_limit():
    """With nobody else waiting, one client's parallel requests all join (llama-server and vLLM
    queue such a batch); the line's own limit still holds, and once another owner waits, the
    per-owner cap binds that owner's next request again."""
    queue = EngineQueue()
    batch = [queue.join(limit=8, owner="a", per_owner=2) for _ in range(9)]  # 1 holds, 8 wait
    assert [t.ahead for t in batch] == list(range(9))
    with pytest.raises(QueueFull) as full:
        queue.join(limit=8, owner="a", per_owner=2)
    assert not full.value.mine and full.value.waiting == 8
    bob = queue.join(limit=8, owner="b", per_owner=2)  # nothing waiting: always a place
    assert bob.ahead == 2  # served in the first round, after a's first waiting reply
    with pytest.raises(QueueFull) as full:
        queue.join(owner="a", per_owner=2)  # b waits: a's 8 places are over its 2
    assert full.value.mine and full.value.waiting == 8


def test_a_waiting_reply_is_told_its_expected_wait_from_recent_replies():
    now = [0.0]
    queue = EngineQueue(clock=lambda: now[0])
    first = queue.join()
    waiting = [queue.join(owner=str(i)) for i in range(2)]
    assert queue.expected_wait(2) is None  # no reply has held the engine yet
    now[0] = 10.0
    first.leave()  # held 10 s
    assert queue.expected_wait(1) == 10.0
    report = next(waiting[1].reports())
    assert report == Waiting(1) and report.message() == \
        "Waiting for the model: 1 ahead of you (about 10 s)."
    now[0] = 210.0
    waiting[0].leave()  # held 200 s: the average moves toward it
    assert queue.expected_wait(3) == pytest.approx(3 * (0.3 * 200 + 0.7 * 10))
    assert Waiting(3, 200.0).message() == "Waiting for the model: 3 ahead of you (about 3 min)."


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
    # by then a reply has held the engine: the wait comes with its expected length
    assert any(r.startswith("Waiting for the model: 1 ahead of you (about ") for r in reports)
    assert reports[-1] == ""
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


def test_past_the_limit_only_an_owner_with_nothing_waiting_gets_a_place():
    """A full line refuses an owner who has a reply waiting already; one who has none joins,
    so no number of other owners' replies shuts a visitor out."""
    queue = EngineQueue()
    queue.join(limit=2, owner="flood")  # holds the engine
    queue.join(limit=2, owner="flood")
    queue.join(limit=2, owner="flood-2")
    with pytest.raises(QueueFull) as full:
        queue.join(limit=2, owner="flood")
    assert not full.value.mine and full.value.waiting == 2
    alice = queue.join(limit=2, owner="alice")
    assert alice.ahead == 3 and queue.waiting == 3  # its turn comes in the first round
    with pytest.raises(QueueFull):
        queue.join(limit=2, owner="alice")  # her second waits for room like anyone's


def test_a_loop_post_hands_items_over_in_order_batched_within_its_interval():
    """The API's reply thread -> its event loop: the first item at once, later ones together
    once the interval has passed, an exception and `Finished` at once; every item, in order."""
    import asyncio

    from specchat.engine_queue import Finished, LoopPost

    async def main():
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        calls = []
        post = LoopPost(loop, queue, interval=3600)  # nothing is handed over by time alone
        wakes = loop.call_soon_threadsafe

        def counted(callback, *args):
            if callback == post._deliver:
                calls.append(args[0])
            return wakes(callback, *args)

        loop.call_soon_threadsafe = counted
        try:
            def reply():
                for item in ("a", "b", "c"):
                    post.put(item)
                post.put(ValueError("bad"))
                post.put("d")
                post.put(Finished())

            await loop.run_in_executor(None, reply)
            await asyncio.sleep(0)
        finally:
            del loop.call_soon_threadsafe
        got = [queue.get_nowait() for _ in range(queue.qsize())]
        assert got[:3] == ["a", "b", "c"] and isinstance(got[3], ValueError)
        assert got[4] == "d" and isinstance(got[5], Finished) and len(got) == 6
        # three wakes: "a" (the first), "b" to the error (an exception), "d" and Finished
        assert [len(batch) for batch in calls] == [1, 3, 2]

    asyncio.run(main())
