"""What every run of the bench asks alike: the prompt, and the sampling set once from the flags."""

from __future__ import annotations

PROMPT = "Write a long story about a ring of small computers that share one mind."

# What every decode request asks beyond greedy (--temperature): set once from the flags.
SAMPLING: dict = {"temperature": 0}

# The seed of a sampled run's requests: each run samples the same tokens, so runs do equal work.
SAMPLED_SEED = 7
