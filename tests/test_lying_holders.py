"""A real `ringd serve --model-from-peers` against holders that lie (tests/kit/liarholder.py).

Whatever a holder says in the headers the fetcher acts on, or however it stops sending,
the node logs why, drops the holder or asks again, and carries on: it never exits with a
traceback, and never waits longer than its deadlines (models/peers.py: STALL_S = 10 s of
silence mid-piece, Retry-After taken as at most MAX_RETRY_AFTER_S = 30 s). The bounds
below are generous (they show "bounded, not forever": the code before them exited, slept
for 1e308 s, or waited 60 s a request, up to 20 times). The model is a tiny random llama.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest
from devkit import REPO
from devkit.liarholder import LiarHolders
from devkit.ports import port

from ringd.base.servecmd import serve_command

# Well above what each case takes now (a Retry-After of 2 s; a stall given up on after 10 s), well
# below what it took before (60 s for one stalled request).
BOUND_S = 45.0
# The reason a staller is dropped: its silence, or its piece not in by the piece's deadline
# (whichever ends first: for a small piece, both come at STALL_S).
STALLED = r"(no byte for 10 s mid-piece|piece \d+ of \S+ not in within 10 s)"


def fetcher(tmp_path: Path, cluster: str, ring_ports: list[int]) -> tuple[subprocess.Popen, Path]:
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)  # tests/kit/fileholder.py's SECRET
    secret.chmod(0o600)
    cmd = serve_command(
        name="fetcher", cluster=cluster, host="127.0.0.1", advertise="127.0.0.1", http_host="127.0.0.1",
        ring_port=port(), http_port=port(), model_from_peers=True, models_dir=tmp_path / "models", secret_file=secret,
        state_dir=tmp_path / "state", discovery=False, peer=[f"127.0.0.1:{p}" for p in ring_ports],
    )  # fmt: skip
    log = tmp_path / "fetcher.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=out, start_new_session=True)
    return proc, log


def wait_for_line(proc: subprocess.Popen, log: Path, pattern: str, bound_s: float = BOUND_S) -> str:
    """The first line of the log that matches, waiting while the node runs (at most ``bound_s``)."""
    deadline = time.monotonic() + bound_s
    while True:
        lines = [line for line in log.read_text().splitlines() if re.search(pattern, line)]
        if lines:
            return lines[0]
        assert proc.poll() is None, f"the node exited ({proc.returncode}):\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no line matching {pattern!r} within {bound_s} s:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture
def tiny(tiny_model) -> Path:
    return tiny_model(arch="llama", layers=4, dtype="float32")


@pytest.mark.parametrize("kind, value", [("data", "soon"), ("data", "nan"), ("manifest", "1e308")])
def test_a_retry_after_that_is_no_number_of_seconds_is_waited_out_bounded(kind, value, tiny, tmp_path):
    """Before: "soon" and "nan" made the node exit 1 with a traceback; "1e308" on the manifest, sleep forever."""
    cluster = f"lie-{os.getpid()}"
    with LiarHolders(tiny, tmp_path / "cache", cluster, {"liar": [(kind, f"503 {value}")]}) as liars:
        proc, log = fetcher(tmp_path, cluster, [liars.ring_ports["liar"]])
        try:
            wait_for_line(proc, log, r"fetched .* from peers in")
            assert liars.lies == [("liar", kind, f"503 {value}")]
            assert "Traceback" not in log.read_text()
        finally:
            stop(proc)


def test_a_holder_that_stalls_mid_piece_is_dropped_and_an_honest_one_beside_it_serves(tiny, tmp_path):
    """Before: the stalled request took READ_TIMEOUT_S (60 s) before the honest holder was asked, the
    warning's reason was empty, and the staller was asked again for the fingerprint's slices."""
    cluster = f"stall-{os.getpid()}"
    with LiarHolders(tiny, tmp_path / "cache", cluster, {"liar": [("data", "stall")], "honest": None}) as liars:
        # The liar first: it is asked first, so it is the one that stalls.
        proc, log = fetcher(tmp_path, cluster, [liars.ring_ports["liar"], liars.ring_ports["honest"]])
        try:
            dropped = wait_for_line(proc, log, r"from liar failed")
            assert re.search(STALLED + r".*; it is asked for nothing more in this fetch \(its pieces go to: honest\)", dropped), dropped
            wait_for_line(proc, log, r"fetched .* from peers in")
            assert liars.lies == [("liar", "data", "stall")]
        finally:
            stop(proc)


def test_a_holder_alone_that_stalls_ends_the_fetch_with_the_reason_and_the_node_asks_again(tiny, tmp_path):
    """Before: 60 s a request, 20 requests in a row (~20 minutes) before the fetch gave up."""
    cluster = f"alone-{os.getpid()}"
    with LiarHolders(tiny, tmp_path / "cache", cluster, {"liar": [("data", "stall")]}) as liars:
        proc, log = fetcher(tmp_path, cluster, [liars.ring_ports["liar"]])
        try:
            line = wait_for_line(proc, log, r"model_from_peers: no holder of model")
            assert re.search(r"liar dropped \(" + STALLED, line) and "asking again" in line, line
            # The next fetch asks it again, and (past its script) it serves.
            wait_for_line(proc, log, r"fetched .* from peers in")
        finally:
            stop(proc)
