"""The pin store: which node name ringctl signs for at each address, pinned the first time it
signs there (as ssh pins host keys), in a JSON file of its own beside ringd's state."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ringd.app.ctl.errors import CtlError

# Where ringctl pins the name of each node it has signed for (HOST:PORT -> name), beside
# ringd's own state.
DEFAULT_KNOWN_NODES = "~/.local/state/ringd/ringctl-nodes.json"


class KnownNodes:
    """The name ringctl signs for at each address, pinned the first time (a JSON object, HOST:PORT -> name)."""

    def __init__(self, path: str):
        self.path = Path(path).expanduser()

    def _fix(self, why: str) -> CtlError:
        return CtlError(f"cannot use {self.path} ({why}); ringctl pins node names there: fix the file or delete it")

    def load(self) -> dict[str, str]:
        try:
            doc = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            raise self._fix(str(e)) from None
        if not isinstance(doc, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in doc.items()):
            raise self._fix("not a JSON object of HOST:PORT to a name")
        return doc

    def pin(self, node: str, name: str) -> None:
        pins = {**self.load(), node: name}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_name(self.path.name + ".partial")
            partial.write_text(json.dumps(pins, indent=1, sort_keys=True) + "\n")
            os.replace(partial, self.path)  # never half a file
        except OSError as e:
            raise self._fix(str(e)) from None
