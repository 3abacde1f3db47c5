"""ringd.models.progress: bytes never past the total, a rate over the last seconds, a log line now and then.

Time is a clock the test steps: nothing here sleeps or reads the wall clock.
"""

from __future__ import annotations

import json
import logging
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringd.models.progress import (
    DOWNLOAD,
    LOAD,
    PROGRESS_LOG_INTERVAL_S,
    RATE_WINDOW_S,
    LoadCancelled,
    LoadProgress,
    describe,
)

WIRE_KEYS = {"phase", "file", "files_done", "files_total", "bytes", "total_bytes", "rate_bytes_s", "layers"}
GiB, MiB = 2**30, 2**20


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


FILES = [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]

sizes = st.dictionaries(st.sampled_from(FILES), st.none() | st.integers(0, 10**12), max_size=4)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("begin"), st.sampled_from([DOWNLOAD, LOAD]), sizes),
        st.tuples(st.just("advance"), st.sampled_from(FILES), st.integers(-(10**12), 10**12)),
        st.tuples(st.just("finish"), st.sampled_from(FILES)),
        st.tuples(st.just("size"), st.sampled_from(FILES), st.integers(0, 10**12)),
        st.tuples(st.just("tick"), st.floats(0, 100, allow_nan=False)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_bytes_never_exceed_the_total_and_the_rate_is_never_negative(steps):
    clock = Clock()
    p = LoadProgress(3, 6, clock=clock)
    for op in steps:
        if op[0] == "begin":
            p.begin(op[1], op[2])
        elif op[0] == "advance":
            p.advance(op[1], op[2])
        elif op[0] == "finish":
            p.finish_file(op[1])
        elif op[0] == "size":
            p.set_size(op[1], op[2])
        else:
            clock.t += op[1]
        w = p.to_wire()
        assert set(w) == WIRE_KEYS
        assert 0 <= w["bytes"] <= w["total_bytes"]
        assert w["rate_bytes_s"] >= 0
        assert 0 <= w["files_done"] <= w["files_total"]
        assert w["phase"] in (DOWNLOAD, LOAD) and w["layers"] == [3, 6]
        assert json.loads(json.dumps(w)) == w  # what a node's status carries as is
        for done, size in p.file_bytes().values():
            assert 0 <= done and (size is None or done <= size)
        describe(w)


def test_the_wire_form_and_its_line():
    clock = Clock()
    p = LoadProgress(3, 6, clock=clock)
    assert p.to_wire() == {
        "phase": "load", "file": "", "files_done": 0, "files_total": 0,
        "bytes": 0, "total_bytes": 0, "rate_bytes_s": 0.0, "layers": [3, 6],
    }  # fmt: skip
    p.begin(DOWNLOAD, {"a.safetensors": 100, "b.safetensors": 300})
    p.advance("a.safetensors", 100)
    p.finish_file("a.safetensors")
    clock.t += 1
    p.advance("b.safetensors", 50)
    assert p.to_wire() == {
        "phase": "download", "file": "b.safetensors", "files_done": 1, "files_total": 2,
        "bytes": 150, "total_bytes": 400, "rate_bytes_s": 150.0, "layers": [3, 6],
    }  # fmt: skip
    line = {
        "phase": "download", "file": "model-00002-of-00004.safetensors", "files_done": 1, "files_total": 4,
        "bytes": int(1.2 * GiB), "total_bytes": int(3.4 * GiB), "rate_bytes_s": 80.0 * MiB, "layers": [3, 6],
    }  # fmt: skip
    assert describe(line) == (
        "downloading layers [3, 6): 1.2 GiB of 3.4 GiB (35%), 80.0 MiB/s, model-00002-of-00004.safetensors (2 of 4 files)"
    )


def test_a_file_of_unknown_size_grows_the_total_until_its_size_is_known():
    p = LoadProgress(0, 2, clock=Clock())
    p.begin(DOWNLOAD, {"a": None})
    p.advance("a", 70)
    assert (p.to_wire()["bytes"], p.to_wire()["total_bytes"]) == (70, 70)
    p.set_size("a", 100)
    p.advance("a", -20)  # a retried download starts over part of the file
    assert (p.to_wire()["bytes"], p.to_wire()["total_bytes"]) == (50, 100)
    p.finish_file("a")  # complete: all of it counts
    assert (p.to_wire()["bytes"], p.to_wire()["files_done"]) == (100, 1)


def test_the_rate_is_over_the_last_seconds_not_since_the_start():
    clock = Clock()
    p = LoadProgress(0, 1, clock=clock)
    p.begin(DOWNLOAD, {"a": 10**9})
    for _ in range(20):  # 20 s at 1000 B/s
        clock.t += 1
        p.advance("a", 1000)
    assert p.to_wire()["rate_bytes_s"] == 1000
    for _ in range(20):  # then 20 s at 10 B/s: the rate is that, not the average since the start
        clock.t += 1
        p.advance("a", 10)
    assert p.to_wire()["rate_bytes_s"] == 10
    clock.t += RATE_WINDOW_S + 1  # a stall: nothing came in the whole window
    assert p.to_wire()["rate_bytes_s"] == 0


def test_a_progress_line_at_most_every_interval_and_one_at_the_end(caplog):
    clock = Clock(0.0)
    p = LoadProgress(3, 6, clock=clock)
    p.begin(DOWNLOAD, {"a.safetensors": 10**6})
    with caplog.at_level(logging.INFO, logger="ringd.models.progress"):
        for _ in range(60):  # 30 s of updates every 0.5 s
            clock.t += 0.5
            p.advance("a.safetensors", 1000)
        p.finish_file("a.safetensors")
        p.end()
    lines = [r.getMessage() for r in caplog.records]
    progress, final = lines[:-1], lines[-1]
    assert len(progress) == 30 / PROGRESS_LOG_INTERVAL_S
    assert all(line.startswith("downloading layers [3, 6): ") and "a.safetensors (1 of 1 file)" in line for line in progress)
    assert final == "downloaded layers [3, 6): 976.6 KiB in 1 file, 30.0 s, 32.6 KiB/s"


def test_read_while_written_from_another_thread():
    p = LoadProgress(0, 4)
    p.begin(LOAD, {f: 1000 * 7 for f in FILES})
    done = threading.Event()

    def write():
        for f in FILES:
            for _ in range(1000):
                p.advance(f, 7)
            p.finish_file(f)
        done.set()

    writer = threading.Thread(target=write)
    writer.start()
    seen = 0
    while not done.is_set():
        w = p.to_wire()
        assert w["bytes"] <= w["total_bytes"] == 28_000 and w["bytes"] >= seen
        seen = w["bytes"]
    writer.join()
    assert p.to_wire()["bytes"] == 28_000 and p.to_wire()["files_done"] == 4


def test_a_cancelled_load_stops_at_its_next_step():
    p = LoadProgress(3, 6, clock=Clock())
    p.begin(DOWNLOAD, {"a": 100})
    p.advance("a", 10)
    p.cancel()  # from the event loop, when the node stops
    with pytest.raises(LoadCancelled, match=r"layers \[3, 6\) was given up"):
        p.advance("a", 10)  # the download's next chunk, on the thread doing it
    with pytest.raises(LoadCancelled):
        p.start_file("b")
    assert p.to_wire()["bytes"] == 10  # still readable
