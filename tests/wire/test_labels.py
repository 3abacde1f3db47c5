"""wire/labels.py: every label a key or a proof is derived from the cluster secret by, once."""

from __future__ import annotations

import re
from pathlib import Path

from wire import labels

ROOT = Path(__file__).resolve().parents[2]
# A bytes literal that starts like one of the house's labels: b"ringd..." or b'ringd...'.
LABEL_LITERAL = re.compile(r"""\bb(["'])ringd""")


def registry() -> dict[str, bytes]:
    return {name: value for name, value in vars(labels).items() if name.isupper() and isinstance(value, bytes)}


def test_the_labels_are_distinct_and_none_is_a_prefix_of_another():
    """Keys of one use never equal another's, and an input MACed for one never starts like another's."""
    found = registry()
    assert len(found) >= 11, f"the registry holds every label: {sorted(found)}"
    assert len(set(found.values())) == len(found), "a label is used twice"
    for a, x in found.items():
        for b, y in found.items():
            assert a == b or not y.startswith(x), f"{a} ({x!r}) is a prefix of {b} ({y!r})"


def test_no_other_module_spells_a_label_of_its_own():
    """A new use of the secret takes its label from wire/labels.py, where the others can be seen."""
    own = ROOT / "wire" / "labels.py"
    offenders = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for pkg in ("ringd", "wire")
        for path in sorted((ROOT / pkg).rglob("*.py"))
        if path != own
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if LABEL_LITERAL.search(line)
    ]
    assert offenders == [], "labels belong in wire/labels.py:\n" + "\n".join(offenders)
