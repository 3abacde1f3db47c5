"""ringd.base.tasks: a loop that raises is logged with its traceback and started again; none dies silently."""

from __future__ import annotations

import asyncio
import logging

import pytest

from ringd.base.tasks import Supervisor


async def until(predicate, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


def test_a_failing_loop_is_logged_and_restarted(caplog):
    async def main():
        runs = []

        async def loop():
            runs.append(1)
            if len(runs) < 3:
                raise RuntimeError(f"bad input number {len(runs)}")
            await asyncio.Event().wait()  # the third run stays up

        s = Supervisor()
        s.forever("heartbeats", loop)
        await until(lambda: len(runs) == 3)
        assert s.restarts == {"heartbeats": 2}
        await s.stop()

    with caplog.at_level(logging.ERROR, logger="ringd.base.tasks"):
        asyncio.run(main())
    failures = [r for r in caplog.records if "task heartbeats failed; restarting it" in r.getMessage()]
    assert len(failures) == 2 and all(r.exc_info for r in failures)  # with the traceback
    assert "bad input number 2" in caplog.text


def test_a_loop_that_returns_is_restarted_unless_it_may(caplog):
    async def main():
        returns, dials = [], []

        async def forever():
            returns.append(1)
            if len(returns) < 2:
                return
            await asyncio.Event().wait()

        async def dial():
            dials.append(1)

        s = Supervisor()
        s.forever("reconcile", forever)
        dialing = s.forever("dial", dial, restart_on_return=False)
        await until(lambda: len(returns) == 2)
        # The supervisor of a loop that may return ends with it: once its task is
        # done, no restart can follow, so one dial is the whole story.
        async with asyncio.timeout(10):
            await dialing
        assert dials == [1] and s.restarts == {"reconcile": 1}
        await s.stop()

    with caplog.at_level(logging.ERROR, logger="ringd.base.tasks"):
        asyncio.run(main())
    assert "task reconcile returned, but it should run as long as the node does" in caplog.text


def test_once_logs_an_exception_and_stop_cancels_everything(caplog):
    async def main():
        s = Supervisor()

        async def boom():
            raise ValueError("load failed")

        started = asyncio.Event()

        async def forever():
            started.set()
            await asyncio.Event().wait()

        t1 = s.once("load plan 3", boom())
        t2 = s.forever("expiry", forever)
        await started.wait()
        await asyncio.wait({t1})
        await s.stop()
        assert t2.cancelled()

    with caplog.at_level(logging.ERROR, logger="ringd.base.tasks"):
        asyncio.run(main())
    assert "task load plan 3 failed" in caplog.text and "load failed" in caplog.text


@pytest.mark.parametrize("exc", [asyncio.CancelledError])
def test_cancellation_passes_through(exc):
    async def main():
        s = Supervisor()

        async def loop():
            await asyncio.Event().wait()

        task = s.forever("x", loop)
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(exc):
            await task
        assert s.restarts == {}

    asyncio.run(main())
