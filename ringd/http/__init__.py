"""HTTP: every API a thin translation of one internal request and its stream of outputs; the guard, auth, the follower's proxy and the dashboard."""
