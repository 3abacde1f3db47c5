"""Where a weights digest reads a file: a few slices spread over its tensor data.

A fine-tune changes nearly every weight, so slices spread over a file's data tell
two models apart as the whole file would, and reading a few hundred KiB keeps a
digest instant on a model of hundreds of GB. One rule for both digests, a
checkpoint directory's (``fingerprint.py``) and a GGUF file's (``gguf/reader.py``), each
with its own count and size; a model fetched from peers reads the same slices
through a ``SampleReader`` where its files are not whole.

Below both on purpose: ``fingerprint.py`` opens GGUF files, so the rule ``gguf/reader.py``
digests with cannot live there. It ignores what is hashed and how.
"""

from __future__ import annotations

from collections.abc import Callable

# (file name, start, end) -> those bytes of the file: a digest's slices, from wherever they are.
SampleReader = Callable[[str, int, int], bytes]


def sample_spans(size: int, data: int, samples: int, sample_bytes: int) -> list[tuple[int, int]]:
    """[start, end) of the slices a digest reads of a file of ``size`` bytes whose data starts at ``data``."""
    starts = (data + (size - data) * i // samples for i in range(samples))
    return [(a, min(a + sample_bytes, size)) for a in starts]
