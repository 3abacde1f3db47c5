"""ringd.stage.compute: the node's one MLX thread.

Jobs run in the order they were queued, on one thread that is not the event
loop's; an awaited job gives its result or raises its exception; a job nobody
awaits that raises is logged and the thread goes on; stopping drops what is
queued (its awaiters are cancelled) and lets the job under way finish. On Linux the
compute thread and MLX's stream thread that runs its evaluations are named and are batch
threads (woken, they do not preempt the thread that woke them). A reading it is lent is read
on it whenever its socket has data, between jobs that still run in order, until it goes back.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import threading
import time

import pytest

from ringd.stage import compute as compute_module
from ringd.stage.compute import COMPUTE_THREAD_NAME, MLX_THREAD_NAME, ComputeThread


def test_jobs_run_in_order_on_one_thread_and_give_their_results():
    async def main():
        compute = ComputeThread()
        seen = []
        try:
            for i in range(50):
                compute.submit(lambda i=i: seen.append((i, threading.get_ident())))
            last = await compute.run(lambda: seen.append((50, threading.get_ident())) or "done")
            return last, seen, threading.get_ident()
        finally:
            await compute.stop()

    last, seen, loop_thread = asyncio.run(main())
    assert last == "done"
    assert [i for i, _ in seen] == list(range(51))
    threads = {t for _, t in seen}
    assert len(threads) == 1 and loop_thread not in threads


def test_an_awaited_job_raises_its_error_and_one_nobody_awaits_is_logged(caplog):
    def boom():
        raise ValueError("no such layer")

    async def main():
        compute = ComputeThread()
        try:
            with pytest.raises(ValueError, match="no such layer"):
                await compute.run(boom)
            compute.submit(boom)
            return await compute.run(lambda: "still up")
        finally:
            await compute.stop()

    with caplog.at_level(logging.ERROR, logger="ringd.stage.compute"):
        assert asyncio.run(main()) == "still up"
    assert any("boom" in r.getMessage() and r.exc_info for r in caplog.records), caplog.text


def test_stopping_drops_what_is_queued_and_lets_the_job_under_way_finish():
    async def main():
        compute = ComputeThread()
        started, release = threading.Event(), threading.Event()
        ran = []

        def slow():
            started.set()
            release.wait(30)
            ran.append("slow")
            return "finished"

        under_way = asyncio.ensure_future(compute.run(slow))
        await asyncio.to_thread(started.wait, 30)
        queued = asyncio.ensure_future(compute.run(lambda: ran.append("queued")))
        compute.submit(lambda: ran.append("submitted"))
        await asyncio.sleep(0)  # both are in the queue, behind the slow job
        stopping = asyncio.ensure_future(compute.stop())
        await asyncio.sleep(0)
        release.set()
        await asyncio.wait_for(stopping, 30)
        with pytest.raises(RuntimeError, match="stopping"):
            await compute.run(lambda: None)
        return await under_way, queued, ran

    result, queued, ran = asyncio.run(main())
    assert result == "finished" and ran == ["slow"]
    assert queued.cancelled()


def test_stop_gives_up_on_a_job_that_does_not_end(caplog):
    async def main():
        compute = ComputeThread()
        started, hung = threading.Event(), threading.Event()

        def stuck():
            started.set()
            hung.wait(30)

        compute.submit(stuck)
        # Under way, not queued: stop drops a queued job, and would have nothing to give up on.
        assert await asyncio.to_thread(started.wait, 30), "the job never started"
        await asyncio.wait_for(compute.stop(timeout_s=0.2), 10)  # returns, with a warning
        hung.set()

    with caplog.at_level(logging.WARNING, logger="ringd.stage.compute"):
        asyncio.run(main())
    warnings = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "ringd.stage.compute"]
    assert warnings == [(logging.WARNING, "MLX work still running after 0 s of stopping; exiting anyway")], warnings


# A process whose MLX-running thread ends while the interpreter finalizes aborts (SIGABRT,
# "terminate called without an active exception") in about one exit of five here: a race, so
# several processes at once, and each must exit as asked.
EXITS = 6
AT_EXIT = """
import threading, mlx.core as mx
from ringd.stage import compute as compute_module
from ringd.stage.compute import COMPUTE_THREAD_NAME, MLX_THREAD_NAME, ComputeThread

started = threading.Event()

def work():
    started.set()
    a = mx.random.normal((256, 256))
    for _ in range(40):
        mx.eval(a @ a)
    print("job done", flush=True)

c = ComputeThread()
c.submit(work)
started.wait()
"""


def test_an_interpreter_exiting_mid_job_lets_it_finish_and_exits_cleanly():
    """The job under way finishes; the thread then parks rather than ends as the interpreter finalizes."""
    from devkit.procs import exits_of

    for code, out in exits_of(AT_EXIT, EXITS):
        assert code == 0 and "job done" in out, out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names and SCHED_BATCH are Linux's")
def test_the_compute_thread_and_mlx_s_thread_for_it_are_named_batch_threads():
    import mlx.core as mx

    def seen(tid: int) -> tuple[str, bool]:
        return open(f"/proc/self/task/{tid}/comm").read().strip(), os.sched_getscheduler(tid) == os.SCHED_BATCH

    async def main():
        compute = ComputeThread()
        try:
            await compute.run(lambda: mx.eval(mx.ones((64, 64)) @ mx.ones((64, 64))))
            own, mlx_thread = compute.thread_ids
            assert own == await compute.run(threading.get_native_id)
            assert mlx_thread is not None and mlx_thread != own
            # MLX's is the thread that sleeps after each of the compute thread's evaluations.
            assert compute_module._woken_by(lambda: None, [mlx_thread]) is None
            step = lambda: mx.eval(mx.add(mx.array(0), mx.array(1)))  # noqa: E731
            assert await compute.run(compute_module._woken_by, step, [mlx_thread]) == mlx_thread
            return seen(own), seen(mlx_thread)
        finally:
            await compute.stop()

    assert asyncio.run(main()) == ((COMPUTE_THREAD_NAME, True), (MLX_THREAD_NAME, True))
    assert not seen(threading.get_native_id())[1]  # the caller's own thread is left as it was


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")
def test_mlx_s_thread_is_told_apart_from_another_started_at_the_same_time():
    """Two threads born while a compute thread starts: the one MLX runs its evaluations on is
    the one that sleeps after each of them, not the other (here another thread's MLX thread)."""
    import mlx.core as mx

    def step():
        mx.eval(mx.add(mx.array(0), mx.array(1), stream=mx.cpu))

    def native() -> set[int]:
        return {int(t) for t in os.listdir("/proc/self/task")} - {t.native_id for t in threading.enumerate()}

    started, done, result = threading.Event(), threading.Event(), {}

    def other():  # a thread with a stream of its own: its MLX thread starts, then idles
        step()
        started.set()
        done.wait()

    def probe():
        before = native()
        neighbour = threading.Thread(target=other)
        neighbour.start()
        assert started.wait(30)
        theirs = native() - before
        step()  # this thread's own MLX thread starts now
        ours = native() - before - theirs
        result.update(theirs=theirs, ours=ours, found=compute_module._woken_by(step, sorted(theirs | ours)))
        done.set()
        neighbour.join()

    prober = threading.Thread(target=probe)
    prober.start()
    prober.join(60)
    assert len(result["theirs"]) == 1 and len(result["ours"]) == 1
    assert {result["found"]} == result["ours"]


class SocketReading:
    """A reading as wire.stream's ``Lent`` is one: the bytes of one end of a socket pair, read
    on the compute thread; a b"!" gives it back."""

    def __init__(self):
        self.ours, self.theirs = socket.socketpair()
        self.ours.setblocking(False)
        self.asked_back = False
        self.waiting = False
        self.got: list[tuple[bytes, int]] = []
        self.reads = 0

    def fileno(self):
        return self.ours.fileno()

    def ask_back(self):
        self.asked_back = True

    def read(self) -> bool:
        self.reads += 1
        if self.asked_back:
            return False
        try:
            data = self.ours.recv(64)
        except BlockingIOError:
            return True
        self.got.append((data, threading.get_ident()))
        return b"!" not in data


async def until(condition, what: str, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        await asyncio.sleep(0.01)


def test_a_watched_reading_is_read_on_the_compute_thread_between_jobs_until_it_goes_back():
    """Jobs queued before ``watch`` run first; then the socket is read on the compute thread as
    bytes arrive, while jobs queued meanwhile still run (a job wakes a thread waiting on
    sockets); a reading is told whether the thread waits on it; one that says it went back is
    read no more; stopping asks back the rest."""

    async def main():
        compute = ComputeThread()
        seen, first, second = [], SocketReading(), SocketReading()
        try:
            compute.submit(lambda: seen.append("before"))
            first.theirs.send(b"early")  # there before it is watched: read once it is
            compute.watch(first)
            compute.watch(second)
            await until(lambda: first.got, "read of the early bytes")
            assert seen == ["before"]
            thread = await compute.run(threading.get_ident)
            assert thread != threading.get_ident() and {t for _, t in first.got} == {thread}
            for i in range(20):  # bytes and jobs, alternating: the thread waits on both
                first.theirs.send(b"%d;" % i)
                assert await compute.run(lambda i=i: seen.append(i) or i) == i
            await until(lambda: b"".join(d for d, _ in first.got).endswith(b"19;"), "the last bytes")
            assert b"".join(d for d, _ in first.got) == b"early" + b"".join(b"%d;" % i for i in range(20))
            assert seen == ["before", *range(20)]
            assert not await compute.run(lambda: first.waiting)  # running a job, it waits on no socket
            await until(lambda: first.waiting and second.waiting, "the thread waiting on both sockets")
            first.theirs.send(b"!")  # gives it back
            await until(lambda: first.got[-1][0] == b"!", "the last read")
            reads = first.reads
            first.theirs.send(b"unread")
            second.theirs.send(b"x")
            await until(lambda: second.got, "a read of the other reading")
            await compute.run(lambda: None)
            assert first.reads == reads  # forgotten: its socket is readable, but never read again
        finally:
            await compute.stop()
        assert second.asked_back  # the node stops: given back

    asyncio.run(main())


def test_a_reading_asked_back_goes_back_before_the_next_job_runs():
    """A job may wait for frames the event loop reads (a tensor-parallel collective): a reading
    asked back before that job was queued is given back before it runs, not after."""

    async def main():
        compute = ComputeThread()
        reading = SocketReading()
        try:
            compute.watch(reading)
            await until(lambda: reading.waiting, "the thread waiting on the socket")
            reading.ask_back()  # the loop's ask, then its job: the thread wakes for the job
            return await compute.run(lambda: (reading.reads, reading in compute._watched))
        finally:
            await compute.stop()

    reads, watched = asyncio.run(main())
    assert reads == 1 and not watched  # given back (its read said so) before the job ran
