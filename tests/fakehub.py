"""test_local.py's import of kit/fakehub.py by its old name: remove when it imports ``kit.fakehub``."""

from kit.fakehub import FakeHub  # noqa: F401
