"""The ring protocol between ringd daemons: frames, tensors, handshake, streams.

Knows nothing of models or HTTP, and never imports `ringd`.
"""
