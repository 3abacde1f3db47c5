"""The leader's index of cached prefixes: which finished requests' KV caches the stages keep.

When a request ends normally its caches can stay on every stage (a RELEASE
with ``keep``), under its request id, holding the positions of the tokens the
ring computed for it: its prompt and all but its last generated token. A new
request whose prompt starts with some of those tokens (a chat continuation:
the same conversation plus one more turn) takes that entry: every stage trims
it to the shared prefix and the prompt's prefill starts there. An entry is
used by one request at a time and taken out of the index meanwhile; the
request's own caches come back as a longer entry when it ends.

The stages keep no index of their own: the leader decides, and evicts (LRU,
and whenever the KV capacity is needed for live requests) with a RELEASE
``evict``. Frames to stage 0 travel the ring in order, so every stage always
holds exactly the entries listed here. A new plan means new stages with empty
stores, and the index is cleared with it.

Sans-I/O: pure bookkeeping over token lists.
"""

from __future__ import annotations

from collections import OrderedDict

# Shorter shared prefixes are not worth taking an entry for (it is used up,
# and a longer match may come): a chat template's first few tokens are the
# same in every request, a real system prompt is longer than this.
MIN_REUSE_TOKENS = 16
# An entry is used up when taken (trimmed to the prefix it shares). A request that would keep less
# than this share of it (a system prompt it has in common with another conversation) computes its
# prompt cold instead, and leaves the entry to the conversation whose next turn reuses all of it.
MIN_REUSE_SHARE = 0.5
# Finished requests whose caches the stages keep for prefix reuse.
DEFAULT_PREFIX_CACHE_ENTRIES = 8


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixIndex:
    def __init__(self, max_entries: int):
        self.max_entries = max_entries
        self._entries: OrderedDict[int, list[int]] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: int) -> bool:
        return key in self._entries

    def take(self, prompt: list[int]) -> tuple[int, int] | None:
        """The entry sharing the longest prefix with ``prompt``, removed: (key, positions to keep).

        At least the prompt's last token is left to compute: the ring samples
        from its position, as in a cold run. An entry it would keep less than
        MIN_REUSE_SHARE of is left for another.
        """
        best, best_len = None, 0
        for key, tokens in self._entries.items():
            n = min(common_prefix(tokens, prompt), len(prompt) - 1)
            if n > best_len and n >= MIN_REUSE_SHARE * len(tokens):
                best, best_len = key, n
        if best is None or best_len < MIN_REUSE_TOKENS:
            return None
        del self._entries[best]
        return best, best_len

    def add(self, key: int, tokens: list[int]) -> list[int]:
        """Index a finished request's caches; returns the keys evicted to stay within max_entries."""
        if self.max_entries <= 0:
            return [key]
        self._entries[key] = list(tokens)
        evicted = []
        while len(self._entries) > self.max_entries:
            evicted.append(self._entries.popitem(last=False)[0])
        return evicted

    def pop_oldest(self) -> int | None:
        if not self._entries:
            return None
        return self._entries.popitem(last=False)[0]

    def clear(self) -> list[int]:
        keys = list(self._entries)
        self._entries.clear()
        return keys

    def tokens(self, key: int) -> list[int]:
        return self._entries[key]

    def keys(self) -> list[int]:
        return list(self._entries)
