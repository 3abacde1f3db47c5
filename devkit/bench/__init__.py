"""Decode throughput: single-process mlx-lm against `ringd local` rings, in one run on one model.

    uv run tools/bench                       # default model, rings of 2 and 3 nodes
    uv run tools/bench --nodes 1,2,3,4 --tokens 256 --hidden-size 2048
    uv run tools/bench --model SmolLM2-135M-Instruct.Q4_1.gguf --nodes 1,2,3
    uv run tools/bench --model SmolLM2-135M-Instruct.Q4_1.gguf --nodes 1,3 --json-schema
    uv run tools/bench --nodes 3 --concurrency 1,2,4,8,16
    uv run tools/bench --nodes 4 --replicas 2 --concurrency 4,8,16
    uv run tools/bench --model SmolLM2-135M-Instruct.Q4_1.gguf --nodes 3 --prefill-pause 3000
    uv run tools/bench --nodes 3 --rate 4 --requests 48
    uv run tools/bench --nodes 1,3 --embeddings 128 --embed-batch 16
    uv run tools/bench --nodes 3 --layers 6 --hidden-size 128 --draft-model self
    uv run tools/bench --nodes 3 --tls
    sudo -E env PATH=$PATH uv run tools/bench --link none,thunderbolt,10gbe,1gbe,wifi --nodes 2,3,4 --concurrency 1,4,8,16 --layers 4 --hidden-size 64 --heads 2 --kv-heads 1 --tokens 64 --repeats 2
    git worktree add /tmp/before HEAD~1 && uv run tools/bench --nodes 3 --baseline /tmp/before

Each figure is greedy decode tokens per second after the first token (prefill
excluded). The ring is measured through its real HTTP API with a streamed
completion, so every token crosses every stage over TCP. All rings are started
first and the runs are interleaved (mlx-lm, ring 2, ring 3, mlx-lm, ...), so a
machine whose speed drifts (a shared VM's memory bandwidth does) affects every
configuration alike; the table gives the median and best of --repeats runs and
the ratios of medians to single-process mlx-lm.

A GGUF file (or ollama:NAME) is served by the rings as it is; mlx-lm, which reads
no GGUF, runs the same model converted once by ``ringd convert`` into the cache.
End-of-sequence does not end a ring's stream (``ignore_eos``, vLLM's option), as
mlx-lm's generate_step never stops on it, so a real model decodes every token
asked for and the ring does the same work as mlx-lm (no logits processor);
mlx_lm.server, which has no such option, has the end tokens barred (logit_bias).

Beside the tokens/s, a CPU table: CPU ms per generated token (user+system of every thread
of every process of the ring, which two shared cores inflate far less than wall time), for
each ring size, and mlx-lm in this process with each token's layers evaluated in as many
pieces as that ring has stages (cut as the ring cuts them, no frames, links or threads):
MLX's own cost of an extra evaluation. Over two sizes or more, the slope of each over the
ring's size is what one extra stage costs, against issue 31's target of 0.30 ms (MLX's extra
evaluation plus at most 0.15 ms of the ring's own work).

``--baseline CHECKOUT`` also starts each ring from another checkout of ringd (the
same environment, that code) and asks it in turn with this code's: a change's
effect, measured on the same machine at the same minutes.

``--json-schema`` also measures each ring with a ``response_format`` JSON schema
(an array of at least --tokens integers, which cannot end within --tokens
tokens): llguidance masks every token at the last stage, and the difference is
the mask's cost per token, as a client sees it.

``--concurrency 1,2,4,8`` measures aggregate throughput instead: N streams at
once (each its own prompt, so no prefix is reused), total tokens over the wall
time from the first request to the last token, prefill included; against
mlx-lm's BatchGenerator given the same N prompts, in the same run.

``--replicas 2`` (with ``--concurrency``; each ring size divisible by it): each ring of N
beside N nodes started with ``--replicas 2`` (two rings of N/2, the leader sending each request
to the one with the least outstanding work), and mlx-lm's BatchGenerator, interleaved: aggregate
tokens/s, CPU ms per generated token of all the ring's processes (user+system), and the requests
each replica took (``/api/ps`` ``served``, read before and after each run). Every token of a
stream crosses every hop of its ring: a ring of 2 has half the hops of a ring of 4.

``--prefill-pause 3000``: two streams decode while a prompt of that many tokens
arrives; the longest gap between two tokens of a running stream while that
prompt prefills, against the prefill's own time (its time to first token).

``--rate 4 --requests 48``: serving latency as vLLM's serving benchmark reports it.
Requests arrive at random (a Poisson process of that many requests per second, the
same seeded arrivals for every server), each its own prompt and --tokens tokens,
streamed; the table gives time to first token (TTFT) and the gaps between a stream's
tokens (ITL), p50 and p99, and the throughput, for each ring and for mlx-lm's own
server (``mlx_lm.server``, which batches concurrent requests) on the same model.

``--embeddings 128 --embed-batch 16``: embeddings instead: inputs embedded per
second through each ring's ``/v1/embeddings`` (a request of --embed-batch inputs of
that many tokens each), against mlx-lm in one process computing the same vectors
for the batch in one pass; each ring's vectors are first compared with mlx-lm's.

``--mlx-pipeline``: also mlx-lm's own pipeline over ``mx.distributed`` for every ring
size of 2 or more: ``mlx.launch --backend ring -n N`` local processes, each running
``sharded_load`` (its layers only) and timed by mlx-lm's own benchmark with the same
prompt length and tokens. It takes the architectures whose mlx-lm code can pipeline
(``--arch deepseek_v3``, ``qwen2``, ``qwen3_moe``, ...), and shows what a user who
splits a model with mlx-lm alone gets on the same machine.

``--tensor-parallel K``: one stream on a ring of K nodes that split every layer (each node on a
core of its own) instead, against mlx-lm in one process on one core, a 1-node ring, and mlx-lm's
own tensor parallelism over K ranks (``mlx.launch --backend ring``, ``sharded_load(...,
tensor_group=...)``, each rank on its own core); then each all-reduce's wall and CPU time, ringd's
and MLX's ring backend's, and the compute per layer above which a group pays. A compute-bound
model shows what a group is for: ``--layers 4 --hidden-size 2048 --heads 16 --kv-heads 4``.

``--tls``: the cost of TLS on a streamed token instead. For each ring size, a ring
with ``--tls auto`` beside a plain one, asked in turn through a follower (so every
token crosses two TLS connections: the leader's stream to the follower, the
follower's to the client): wall ms per token, and CPU ms per token of the ring's
processes and of the client's reading thread, TLS against plain, same run.

``--pin-cores K`` (Linux, a machine with room): this process (mlx-lm, the client) on its
first K cores, each node of a ring on its own K: the ring's processes never share a core,
as Macs do not.

``--draft-model PATH`` (or ``self``: the model as its own draft, which always agrees
but costs as much as the model; or ``early:K``, for a generated model: a pair built from
it, a target whose layers from K on leave the residual stream as it is, though they
still compute, and a draft of its first K layers, which agrees with it while costing
K layers): speculative decoding. Each ring also runs with the draft on its leader; mlx-lm runs
``speculative_generate_step`` with the same draft and num_draft_tokens. The table adds
both, and the share of proposals each kept; with ``--baseline``, the baseline's code with the
draft too. ``--temperature 0.8``: every run samples instead (a fixed seed: each run the same
tokens), so a draft speculates by speculative sampling where the code does it.

``--link thunderbolt,wifi`` (root: network namespaces): rings over links as Macs have them. Each
node runs ``ringd serve`` on a host of its own (a network namespace, devkit/netns.py) whose one
interface is a link of that profile, emulated in userspace by one Python process
(devkit/linkshape.py: latency, jitter, loss, rate; the kernel has no netem); the nodes dial each
other by IP. The client sits on the leader's host, as a user on the leader Mac: its requests cross
no link, the ring's steps do. For each ring size the same ring on loopback runs alongside and the
two are asked in turn: its time per token is the compute (and the ring's own work) in the theory
``loopback + hops x one way``, where one way is half the mean TCP round trip of a decode row
between two of the hosts, measured first (the emulator's own cost and Wi-Fi's lost segments
included), and hops are the links a step crosses (the leader's plan). With ``--concurrency``, N
streams' aggregate tok/s against the bound that micro-batches in flight allow: the links hidden
as far as the loopback rate allows, and what it would be with nothing hidden. CPU ms per token
of the rings' processes, and of the emulator, beside them; the emulator's own cost per crossing
is measured first (a link of no latency through it against a plain bridge), and ``none`` among the
profiles runs a ring over such links: the emulator's own cost to a ring, a control for the others.
"""

# One module a concern (tools/bench, the command users run, calls cli.main):
#   cli          the flags, their checks, the model, the rings started, the mode dispatched to
#   settings     the prompt and the sampling every run asks alike
#   measure      CPU seconds and context switches from /proc, --pin-cores, a slope
#   reference    mlx-lm: one process, in pieces, BatchGenerator, its pipeline, a GGUF's copy
#   rings        `ringd local` rings started and stopped, and asked: one stream, N at once
#   decode       the default mode: decode tokens/s, CPU per stage, baseline, schema, pipeline
#   draft        --draft-model: speculative decoding in mlx-lm and on a ring
#   concurrency  --concurrency;  replicas  --replicas;  embeddings  --embeddings
#   prefill      --prefill-pause;  serving  --rate;  tlscost  --tls
#   links        --link, over linkhosts (namespace hosts, emulated links) and theory (its bounds)
#   tensor       --tensor-parallel: groups against one process and mlx-lm's own, the all-reduce
