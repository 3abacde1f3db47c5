"""Weights that travel between peers: a node with no model fetches the bytes its stage needs.

With ``model_from_peers``, a node that has no model of its own asks the peers that
hold one (``http/files.py``) for it: first the signed manifest (models/peers/manifest.py),
the config and tokenizer files and every weights file's header, into a directory
under ``models_dir`` named by the model; then, for each plan that gives the node
layers, the bytes of those layers' tensors (and the embeddings or head where its
place in the ring needs them, ``checkpoint.stage_keeps``), before the stage loads.

The files are laid out as the holder's, at the same offsets, sparse: what the node
has not fetched is a hole that takes no disk. So the directory is an mlx-lm
checkpoint (or GGUF file) the stage loads as it loads any other, reading only its
own tensors, and the next plan's layers are added to it. ``ringd-peer.json`` says
whose model it is (its fingerprint, which cannot be read from files with holes). Once the
config and headers are in, the fingerprint is made again, as the holder made it, from them
and the slices of the weights its digest reads (asked of a holder where this node has no
piece there): a manifest that is not the model it names is refused before a byte of it loads.

Every piece (a tensor, or part of a long one: models/peers/manifest.py) is checked against
the manifest's BLAKE3 before it is written; a piece that does not match
is refused, its holder named in the log and asked for nothing more, and the piece
fetched from another holder (the fetch fails, naming the holder, when none is
left). Each file has a journal of the pieces written and checked, appended after
each: a fetch stopped by kill -9 starts again where it was, and a piece not in its
journal is never taken for fetched, whatever the file holds there. Several holders serve at once, a few streams each; the hashing and
writing run off the event loop.

A holder is trusted for nothing it says beyond what is checked: every header acted on
is parsed defensively (Retry-After bounded, ``retry_after``), every step of a request
has a deadline (connecting, the answer's head, each read of the body, each piece at a
floor rate), and a holder that stalls is dropped from the fetch at once, one that fails
MAX_HOLDER_FAILURES requests in a row after them, each with the reason in the log and
its pieces asked of the others; with nobody left the fetch ends in a FetchError that
names each. With ``ring_encryption`` the bytes are asked for sealed (models/peers/sealing.py)
and opened, off the event loop, before a piece is checked.

The package, by concern: ``fetch`` (PeerModel, and one fetch's streams over the holders),
``journal`` (the sparse files and the journal of pieces written and checked), ``ranges``
(one range request, its body into the caller's buffers) and ``client`` (a holder's
address, the deadlines, the manifest request, Retry-After, what a failed request is).
What the rest of ringd uses is named here.
"""

from ringd.models.peers.client import HOLDER_RETRY_S, MAX_RETRY_AFTER_S, FetchError, Holder, retry_after
from ringd.models.peers.fetch import PeerModel

__all__ = ["HOLDER_RETRY_S", "MAX_RETRY_AFTER_S", "FetchError", "Holder", "PeerModel", "retry_after"]
