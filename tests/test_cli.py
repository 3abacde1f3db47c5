"""ringd/app/cli.py: how a stopped daemon's process ends (the commands themselves are driven
end to end by test_local.py, test_demo.py and the ring tests)."""

from __future__ import annotations

from devkit.procs import exits_of

# A process that finalizes while a thread is in MLX aborts in about one exit of three here
# (a race): several at once, and each must exit as asked.
EXITS = 6
STOPPED = """
import logging, sys, threading, mlx.core as mx
from ringd.app.cli import _exit_stopped

def busy():
    s = mx.new_stream(mx.cpu)
    with mx.stream(s):
        a = mx.random.normal((256, 256))
        while True:
            mx.eval(a @ a)

running = threading.Event()
threading.Thread(target=lambda: (running.set(), busy()), daemon=True).start()
running.wait()
logging.basicConfig(stream=sys.stderr, level=logging.INFO)
logging.getLogger("ringd").info("the last line")
_exit_stopped(3)
"""


def test_a_stopped_daemon_exits_with_its_code_and_its_last_log_line_whatever_mlx_is_doing():
    for code, out in exits_of(STOPPED, EXITS):
        assert code == 3 and "the last line" in out and "terminate" not in out, out
