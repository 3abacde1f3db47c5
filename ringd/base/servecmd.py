"""The one builder of a ``ringd serve`` command line, for whoever starts daemons as processes:
``ringd local``, the benches, the tests. Flags are the config table's keys (config.py), so a
key renamed there is renamed here by the same test that checks the table.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path

Flag = str | int | float | bool | Path | Iterable[str] | None


def serve_command(python: str = sys.executable, **flags: Flag) -> list[str]:
    """``python -m ringd serve`` with each keyword as its flag: ``ring_port=5`` is ``--ring-port 5``,
    a list repeats the flag (``peer=["a:1", "b:2"]``), a bool is ``true``/``false``, None is left out.
    Keywords keep their order, so a command reads as it was written."""
    cmd = [python, "-m", "ringd", "serve"]
    for key, value in flags.items():
        if value is None:
            continue
        flag = f"--{key.replace('_', '-')}"
        if isinstance(value, bool):
            cmd += [flag, "true" if value else "false"]
        elif isinstance(value, (str, int, float, Path)):
            cmd += [flag, str(value)]
        else:
            for item in value:
                cmd += [flag, str(item)]
    return cmd
