"""BlockTrie against a brute-force longest-common-prefix over random sequences."""

from __future__ import annotations

import random

import pytest

from tiercache.serve.radix import BlockTrie


def _lcp(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("block", [1, 3, 4, 16], ids=lambda b: f"block{b}")
def test_longest_and_prefixes_match_brute_force(block):
    rng = random.Random(block)
    trie, stored = BlockTrie(block), {}
    for step in range(300):
        base = rng.choice(list(stored.values())) if stored and rng.random() < 0.7 else ()
        ids = tuple(base[: rng.randint(0, len(base))]) + tuple(rng.randint(0, 2) for _ in range(rng.randint(1, 12)))
        if rng.random() < 0.3 and stored:  # remove one
            key = rng.choice(list(stored))
            trie.remove(stored.pop(key), key)
        elif ids not in stored.values():
            stored[step] = ids
            trie.insert(ids, step)
        query = tuple(ids[: rng.randint(0, len(ids))]) + tuple(rng.randint(0, 2) for _ in range(rng.randint(0, 6)))
        keys, n = trie.longest(query)
        best = max((_lcp(s, query) for s in stored.values()), default=0)
        assert n == best
        assert keys == ({k for k, s in stored.items() if _lcp(s, query) == best} if best else set())
        assert trie.prefixes_of(query) == {k for k, s in stored.items() if query[: len(s)] == s}


def test_remove_prunes_branches():
    trie = BlockTrie(2)
    trie.insert((1, 2, 3), "a")
    trie.remove((1, 2, 3), "a")
    assert trie.root.children == {} and trie.longest((1, 2, 3)) == (set(), 0)
