"""The dev kit: what tests/conftest.py's fixtures, the tests and the benches in tools/ build on.

One concern a module: ``procs`` (child processes and their output), ``rings`` (a `ringd local`
ring), ``cluster`` (`ringd serve` daemons one by one, and what their /health says), ``clients``
(chat completions as a client sends and reads them), ``faults`` (a dropped link, a blocked event
loop), ``reference`` (mlx-lm's own answers); then the builders of test models (``tinysmol``,
``thinkmodel``, ``ggufmake``, ``kquants``, ``buildcache``), the stand-ins for other machines
(``fakehub``, ``localindex``, ``fileholder``, ``liarholder``, ``relay``, ``flood``), the hosts and
links of a network (``netns``, ``linkshape``), free ports (``ports``), stages in this process
(``stagering``), the tools/ scripts as modules (``toolscript``), and tools/bench's modes
(``bench``, a package).

Importable as ``devkit`` wherever the checkout is installed (``uv sync`` installs it editable, with
the checkout on sys.path); not part of the wheel (pyproject packages ringd and wire only).
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Prefill chunk used by test rings and by the mlx-lm reference alike: small, so
# ordinary prompts already span several chunks.
TEST_PREFILL_CHUNK = 16
RING_START_TIMEOUT_S = 120.0
