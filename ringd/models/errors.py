"""What goes wrong with a model, as the errors every part of ``models/`` raises.

At the bottom of ``models/``: the readers (checkpoint, GGUF, vocab), the sources
(directory, Hub, GGUF file, Ollama store, peers) and whatever sits above them raise
and catch these without importing one another. Errors of one module's own work
(a manifest, a fetch from peers, a package index) are subclasses kept with it.
"""

from __future__ import annotations


class ModelError(ValueError):
    """The model cannot be served by a ring: unsupported, incomplete, bad range."""


class ModelFileError(ModelError):
    """A file of the model on this disk is not what it claims to be: invalid JSON, a corrupt
    or truncated safetensors file. Trying again reads the same bytes: it is not transient,
    and the message names the file and what is wrong with it."""
