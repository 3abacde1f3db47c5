"""A Python program run on N local ranks by ``mlx.launch --backend ring``: mlx-lm's own
distributed paths (its pipeline, its tensor parallelism), which the tests and the benches
compare rings with.

MLX's ring backend on loopback loses a peer now and then ("[ring] connection to a peer was
lost"), so a run is tried again on another range of ports until ``done`` finds what it wants
in the ranks' output.
"""

from __future__ import annotations

import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, TypeVar

T = TypeVar("T")


def run_ranks(program: str, args: list[str], ranks: int, done: Callable[[str], T | None], tries: int, timeout_s: float) -> tuple[T | None, str]:
    """``program`` (Python source, run by this interpreter) with ``args`` on ``ranks`` local ranks,
    up to ``tries`` times: what ``done(stdout)`` returns for the first run it accepts (not None),
    and the last run's stderr (why the last try failed, when none was accepted)."""
    launcher = Path(sys.executable).with_name("mlx.launch")
    with tempfile.TemporaryDirectory() as tmp:
        # mlx.launch runs a program, not a module: the source as a script of this interpreter.
        script = Path(tmp) / "mlx-launch-program"
        script.write_text(f"#!{sys.executable}\n{program}")
        script.chmod(0o755)
        stderr = ""
        for _ in range(tries):
            cmd = [
                str(launcher), "--backend", "ring", "-n", str(ranks), "--hosts", "127.0.0.1",
                "--starting-port", str(random.randrange(20000, 60000)), str(script), *args,
            ]  # fmt: skip
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
            found = done(r.stdout)
            if found is not None:
                return found, r.stderr
            stderr = r.stderr
        return None, stderr
