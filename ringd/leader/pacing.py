"""How many tokens a prompt's chunk takes: as many as a stage computes in a set time.

A request that arrives while a long prompt prefills waits, at each stage, behind the
chunks ahead of it there (about one per slot in flight), so its first token comes some
three chunks' time later, however short its own prompt. A chunk of a fixed 512 tokens is
20 ms of a stage on one ring and 600 ms on another (a 70B model's share of a Mac mini;
MLX's CPU backend): a count cannot bound that wait, a time can. The pacer keeps an
estimate of what one prompt token costs the ring's slowest stage and sizes the chunks
so one takes ``target_s`` there, never more than the configured chunk (a fast ring keeps
its full chunks, and their speed) nor fewer than MIN_PACED_CHUNK.

What it measures is the leader's own view, no stage reports anything: a chunk's trip
around the ring, divided by the micro-batches in flight when it came back (itself among
them). By Little's law that is the time the ring gives each micro-batch: the slowest
stage's time for a chunk while a long prompt's chunks keep every stage busy (each waits
its turn there); the whole trip when the chunk went alone, which is what a request
arriving then waits too. A chunk's fixed cost (the hop, an evaluation's overhead) is
folded into the estimate per token, so the chunk settles where its whole time is the
target.

Sans-I/O: the engine says how long each micro-batch took (its clock) and how many were in
flight, and reads ``chunk``; tests/leader/test_pacing.py drives it with a simulated pipeline.
"""

from __future__ import annotations

# A stage's time for one chunk of a prompt: a new request's first token waits about three
# (one per stage at work, one for a slot), so a short chat behind a long prompt answers
# within about 0.6 s instead of three full chunks' time. Long prompts lose a chunk's fixed
# cost per 0.2 s (a hop and an evaluation: about 1 %).
DEFAULT_PREFILL_CHUNK_S = 0.2
# The fewest tokens a paced chunk takes: below it a chunk's fixed cost (a hop, an
# evaluation) weighs on a long prompt's prefill more than the wait it saves.
MIN_PACED_CHUNK = 32
# Paced chunks are whole multiples of this: Metal's matmul kernels tile rows by 32, and a
# chunk that wandered a token at a time would change every estimate's rounding for nothing.
CHUNK_QUANTUM = 32
# Weight of the newest measure in the estimate of a token's time: a ring's speed changes
# with the prompt's length (attention grows with it) and with the Macs' load.
SMOOTHING = 0.5
# The most a chunk grows from one measure to the next: the first measures of a prompt
# (an idle ring, a whole trip) and a hiccup must not swing it to the bound and back.
MAX_GROWTH = 2


class ChunkPacer:
    """Prompt chunks sized to ``target_s`` of the slowest stage, at most ``most`` tokens."""

    def __init__(self, target_s: float, most: int):
        if not target_s > 0 or most < 1:
            raise ValueError(f"a paced chunk needs a time above 0 s and room for a token, got {target_s} s and {most} tokens")
        self.target_s = target_s
        self.most = most
        self.token_s: float | None = None  # the ring's time per prompt token of a chunk, its fixed cost included
        self.chunk = most  # the tokens a chunk takes now

    def reset(self) -> None:
        """Another ring (other Macs, other layers): nothing measured counts."""
        self.token_s, self.chunk = None, self.most

    def came_back(self, trip_s: float, prompt_tokens: int, in_flight: int) -> int:
        """A micro-batch carrying ``prompt_tokens`` of a prompt's chunk (0: decode rows) came back
        after ``trip_s``, with ``in_flight`` micro-batches around the ring then, itself included;
        the chunk now."""
        if prompt_tokens < MIN_PACED_CHUNK or not trip_s > 0 or in_flight < 1:
            return self.chunk  # a prompt's short tail measures mostly the fixed costs; a clock that did not move, nothing
        per = trip_s / in_flight / prompt_tokens
        if not per > 0:
            return self.chunk  # a trip too short to say anything (its time a token rounds to 0)
        self.token_s = per if self.token_s is None else SMOOTHING * per + (1 - SMOOTHING) * self.token_s
        fit = self.target_s / self.token_s  # may be inf: a measure of almost nothing
        want = self.most if fit >= self.most else int(fit) // CHUNK_QUANTUM * CHUNK_QUANTUM
        self.chunk = min(self.most, max(MIN_PACED_CHUNK, want), self.chunk * MAX_GROWTH)
        return self.chunk
