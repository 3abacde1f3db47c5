"""Every label a key or a proof is derived from the cluster secret by, in one place.

One secret keys every use: the ring's handshake and sessions, the HTTP routes'
signatures, the weight files' seals and the cluster CA. Each use names itself
with its own label, so that no key of one use ever equals a key of another, and
no proof made for one passes as another's. A label is never reused: a new scheme,
or a changed one, gets a new label (the version at its end), never an old one.
tests/wire/test_labels.py checks that they are distinct, that none is a prefix
of another, and that no other module spells a label of its own.

Here, at the lowest floor, because wire/ never imports ringd/ and ringd/ may
import wire/.
"""

# The ring (wire/handshake.py, wire/seal.py). v2 of the proof and v3 of the sessions'
# keys (the MAC is keyed BLAKE3, protocol 5; v2 keyed HMAC-SHA256).
HANDSHAKE_PROOF = b"ringd-handshake-v2|"  # HMAC(secret, this + role + transcript): a side's PROOF
SESSION_KEYS = b"ringd-session-v3|"  # HKDF info prefix: a connection's two direction keys (+ mode + direction)

# Signed HTTP requests (ringd/security/auth.py): each scheme's key is HMAC(secret, its key label),
# and the message it signs starts with its own first line.
CONTROL_KEY = b"ringd control-route key v1"  # the key that signs ringctl's control requests
CONTROL_SIGNED = b"ringd-control-v1"  # first line of a signed control request
FORWARD_KEY = b"ringd forwarding key v1"  # the key a follower signs an API call forwarded to its leader with
FORWARD_SIGNED = b"ringd-forward-v1"  # first line of a forwarded request's proof
FILES_KEY = b"ringd weight-files key v1"  # the key that signs a fetch of a model's files, and the holder's answer
FILES_SIGNED = b"ringd-files-v1"  # first line of a signed file request
FILES_BODY_SIGNED = b"ringd-files-body-v1"  # first line of a holder's signature over its answer

# A model's files sealed for one fetcher (ringd/models/peers/sealing.py).
FILES_SEAL_KEY = b"ringd-files-seal-v1"  # HKDF info prefix: one answer's AES-256-GCM key (+ path, start, count)

# The cluster CA (ringd/security/tlsca.py).
CLUSTER_CA_KEY = b"ringd cluster CA key v1"  # HKDF salt: the CA's P-256 private key (info: the cluster's name)
