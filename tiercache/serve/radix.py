"""A trie over blocks of token ids: which stored sequences share the longest prefix with a query.

    trie = BlockTrie(block_size=16)
    trie.insert(ids, key)            # key: any hashable (the store uses its entries)
    trie.remove(ids, key)
    keys, n = trie.longest(ids)      # every key sharing the longest prefix with ids; n: its length
    trie.prefixes_of(ids)            # keys whose whole sequence is a prefix of ids (or equal to it)

Sequences are cut into blocks of ``block_size`` tokens; the last block may be shorter. A node
holds the keys of every sequence passing through it, so a lookup walks whole blocks and then
compares the next block token by token with the node's children: O(len / block_size) dict steps
plus one partial block per child at the stopping node.
"""

from __future__ import annotations


class _Node:
    __slots__ = ("children", "under", "ends")

    def __init__(self):
        self.children: dict[tuple, _Node] = {}
        self.under: set = set()  # keys of sequences through this node
        self.ends: set = set()  # keys of sequences ending at this node


def _common(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class BlockTrie:
    def __init__(self, block_size: int = 16):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block = block_size
        self.root = _Node()

    def _blocks(self, ids):
        ids = tuple(ids)
        return [ids[i:i + self.block] for i in range(0, len(ids), self.block)]

    def insert(self, ids, key) -> None:
        node = self.root
        node.under.add(key)
        for b in self._blocks(ids):
            node = node.children.setdefault(b, _Node())
            node.under.add(key)
        node.ends.add(key)

    def remove(self, ids, key) -> None:
        node = self.root
        node.under.discard(key)
        path = []
        for b in self._blocks(ids):
            child = node.children.get(b)
            if child is None:
                return
            path.append((node, b, child))
            child.under.discard(key)
            node = child
        node.ends.discard(key)
        for parent, b, child in reversed(path):  # prune emptied branches
            if not child.under:
                del parent.children[b]

    def longest(self, ids) -> tuple[set, int]:
        """Keys sharing the longest common prefix with ``ids``, and its length (0: nothing shared)."""
        ids = tuple(ids)
        node, n = self.root, 0
        while n + self.block <= len(ids) and ids[n:n + self.block] in node.children:
            node = node.children[ids[n:n + self.block]]
            n += self.block
        rest = ids[n:n + self.block]
        best, keys = 0, set()
        for b, child in node.children.items():
            k = _common(b, rest)
            if k > best:
                best, keys = k, set(child.under)
            elif k == best and k > 0:
                keys |= child.under
        if best == 0:
            keys = set(node.under) if n > 0 else set()
        return keys, n + best

    def prefixes_of(self, ids) -> set:
        ids = tuple(ids)
        node, found = self.root, set(self.root.ends)
        for b in self._blocks(ids):
            if len(b) < self.block:  # a partial tail: stored tails that are prefixes of it
                for key_block, child in node.children.items():
                    if len(key_block) <= len(b) and b[:len(key_block)] == key_block:
                        found |= child.ends
                break
            # whole blocks: stored partial tails that are prefixes of this block end here too
            for key_block, child in node.children.items():
                if len(key_block) < self.block and b[:len(key_block)] == key_block:
                    found |= child.ends
            node = node.children.get(b)
            if node is None:
                break
            found |= node.ends
        return found
