"""tools/bench's import of kit/netns.py by its old name (bench puts tests/ on sys.path): remove
when bench imports ``kit.netns``."""

from kit.netns import NetnsHosts, netns_available  # noqa: F401
