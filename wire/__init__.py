"""The ring protocol between ringd daemons: frames, seals, tensors, handshake, streams.

Knows nothing of models or HTTP, and never imports `ringd`.
"""
