"""``ringctl``: look at a running ring from any node's HTTP port.

``ringctl status`` prints the cluster as the node asked sees it: every node, its
address, role, stage and layers, parameter and KV memory, live sessions, the
plan term it runs and its readiness; linked nodes outside the ring too
the leader's throughput and any model download or load under way, with
its file, bytes and rate (``--json`` for the raw document); ``plan`` the ring's order and layer ranges;
``leader set NODE`` pins the leader (the pin outlives restarts) and ``leader
auto`` unpins; ``drain NODE`` keeps a node out of the ring (``--undo`` takes it
back); ``models`` lists every model the node could serve (the Ollama store, the
Hugging Face cache, its ``models_dir``; the loaded one marked) with its size,
quant and architecture, and whether the cluster's memory holds it. It talks HTTP to any one node (``--node HOST:PORT``, default the local
daemon) and never to the ring port.

A node with TLS on answers plain HTTP with a 400 that says so; ringctl then
speaks https to it (or at once, given ``--node https://HOST:PORT``), trusting
``--ca FILE``, or else the cluster CA it derives from the secret and the
cluster's name (``--cluster``). ``tls-ca`` prints that CA, for clients to
trust: it needs only the secret.

Control verbs (leader, drain) change the cluster, so ringctl signs them with
the cluster secret (``--secret-file``, by default where ``ringd serve`` looks;
``auth.py`` has the scheme); without it a node refuses them. ``status`` and
``plan`` on a node with API keys need a key (``--api-key`` or RINGD_API_KEY) or
the secret.

A signature is for one node, by name. The name is the user's when given
(``--node-name NAME``, or ``--node NAME@HOST:PORT``); otherwise ringctl takes
what the node's open ``/health`` says the first time it signs for that
address and pins it (``--known-nodes``, as ssh pins host keys). Either way, a
node whose answer names another node gets nothing signed, and the error names
both: a fake node cannot have ringctl sign for a node it is not.

``top`` is ``status`` redrawn live, with the leader's throughput and each
node's model download/load progress when the node reports them.

``install --config FILE`` makes ``ringd serve`` a service of this machine (a
launchd job on macOS, a systemd unit on Linux; ``service.py`` builds it),
``uninstall`` takes it out, ``logs`` shows its log.

The package, by concern: ``client`` (one request to one node: trust, credentials, signing),
``pins`` (the node names pinned per address), ``render`` (what status, plan, models and ps
print), ``top``, ``install`` (the service commands), ``commands`` (the command line).
"""

from ringd.app.ctl.commands import main

__all__ = ["main"]
