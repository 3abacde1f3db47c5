"""tools/bench-stage: it runs a middle stage's step both ways and prints every figure."""

import subprocess
import sys

from devkit.toolscript import TOOLS


def test_a_middle_stage_is_measured_against_its_layers_alone():
    done = subprocess.run(
        [sys.executable, str(TOOLS / "bench-stage"), "--steps", "20", "--repeats", "1"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    for name in ("runner._forward", "the shard's step alone", "Forward.parse", "the runner own work"):
        [line] = [line for line in lines if line.startswith(name)]
        float(line.rsplit(maxsplit=1)[1])  # a figure, not an error
