"""tools/bench's import of kit/linkshape.py by its old name (bench puts tests/ on sys.path): remove
when bench imports ``kit.linkshape``."""

from kit.linkshape import Profile, profile  # noqa: F401
