"""The prefix cache: a radix tree from token ids to the KV slots that hold them, on top of the token
pool (no block rounding: a shared prefix of 1,000 tokens is shared to the token).

Each node holds an edge of the tree: `tokens` (a run of token ids) and `slots` (their KV slots in
the pool, one per token), so the path from the root to a node spells a prompt prefix and holds
its KV. The tree owns the slots of its nodes. A sequence that reads a path locks its deepest node
(`lock`): every node on the path gets one more reference and is never evicted while the sequence
runs. Nodes without references stay cached, and are evicted least recently used, leaves first,
when the pool needs room (`evict`, called by the pool's `alloc`).

Invariant: a node's references >= the sum over its children (a lock takes the whole path), so an
unreferenced node has only unreferenced descendants, and `evictable` (the slots of unreferenced
nodes) can all be freed by evicting leaves repeatedly.
"""
from __future__ import annotations

import heapq
from array import array
from itertools import count


class Node:
    __slots__ = ("tokens", "slots", "children", "parent", "refs", "last_used")

    def __init__(self, tokens: array, slots: array, parent: Node | None):
        self.tokens = tokens  # the edge from the parent: token ids
        self.slots = slots  # their KV slots
        self.children: dict[int, Node] = {}  # first token of the child's edge -> child
        self.parent = parent  # None once evicted (and for the root)
        self.refs = 0  # locks by running sequences on paths through this node
        self.last_used = 0


def common_length(a: array, b: array) -> int:
    """Length of the common prefix of two token runs."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case, compared in C
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class PrefixCache:
    def __init__(self, pool):
        """pool: the KV pool whose slots the tree holds (its `free(slots)` takes evicted ones back)."""
        self.pool = pool
        self.root = Node(array("q"), array("q"), None)
        self.root.refs = 1  # never evicted
        self.cached = 0  # slots held by the tree
        self.evictable = 0  # of them, slots of unreferenced nodes
        self._clock = count(1)
        self._order = count()  # ties in the heap
        self._leaves: list = []  # (last_used, order, node): unreferenced leaves, stale entries skipped
        self.num_nodes = 0

    # ---- lookup and insertion ------------------------------------------------------------------
    def match(self, node: Node, tokens) -> tuple[Node, array]:
        """Follow `tokens` (a list or array of ids) down from `node` as far as the tree has them ->
        (the deepest node reached, the slots of the matched tokens). A match that ends inside an
        edge splits that edge, so the result is always a node boundary. Nothing is locked."""
        if not isinstance(tokens, array):
            tokens = array("q", tokens)
        slots = array("q")
        i = 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            k = common_length(child.tokens, tokens[i : i + len(child.tokens)])
            if k < len(child.tokens):
                child = self._split(child, k)
            slots += child.slots
            i += k
            node = child
        return node, slots

    def insert(self, node: Node, tokens, slots: array) -> Node:
        """A new leaf under `node` holding `tokens` and their `slots` (the tree takes them) -> the
        leaf, unlocked. `node` must not have a child starting with tokens[0] (match first)."""
        tokens = tokens if isinstance(tokens, array) else array("q", tokens)
        assert len(tokens) == len(slots) > 0 and tokens[0] not in node.children
        leaf = Node(tokens, array("q", slots), node)
        node.children[tokens[0]] = leaf
        leaf.last_used = next(self._clock)
        self.num_nodes += 1
        self.cached += len(tokens)
        self.evictable += len(tokens)
        self._push(leaf)
        return leaf

    def _split(self, child: Node, k: int) -> Node:
        """Cut child's edge after k tokens: a new node takes the first k and becomes child's parent."""
        parent = child.parent
        head = Node(child.tokens[:k], child.slots[:k], parent)
        head.refs, head.last_used = child.refs, child.last_used
        head.children[child.tokens[k]] = child
        parent.children[child.tokens[0]] = head
        child.tokens, child.slots, child.parent = child.tokens[k:], child.slots[k:], head
        self.num_nodes += 1
        return head

    # ---- references ----------------------------------------------------------------------------
    def lock(self, node: Node) -> None:
        """One more reader of the path root..node: none of it is evicted until `unlock(node)`."""
        now = next(self._clock)
        while node is not None:
            if node.refs == 0:
                self.evictable -= len(node.tokens)
            node.refs += 1
            node.last_used = now
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not None:
            node.refs -= 1
            if node.refs == 0:
                self.evictable += len(node.tokens)
                if not node.children:
                    self._push(node)
            node = node.parent

    # ---- eviction ------------------------------------------------------------------------------
    def _push(self, leaf: Node) -> None:
        heapq.heappush(self._leaves, (leaf.last_used, next(self._order), leaf))
        if len(self._leaves) > 2 * self.num_nodes + 1024:  # mostly stale entries: rebuild
            self._leaves = [(n.last_used, next(self._order), n) for n in self._unreferenced_leaves()]
            heapq.heapify(self._leaves)

    def _unreferenced_leaves(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node.refs == 0:
                yield node

    def evict(self, n: int) -> int:
        """Free at least n slots (fewer if the unreferenced nodes hold fewer), least recently used
        leaves first -> the number freed."""
        freed = 0
        while freed < n and self._leaves:
            last_used, _, node = heapq.heappop(self._leaves)
            if node.parent is None or node.children or node.refs or node.last_used != last_used:
                continue  # stale: evicted, no longer a leaf, locked, or used since
            parent = node.parent
            del parent.children[node.tokens[0]]
            node.parent = None
            self.pool.free(node.slots)
            freed += len(node.slots)
            self.cached -= len(node.slots)
            self.evictable -= len(node.slots)
            self.num_nodes -= 1
            if parent is not self.root and parent.refs == 0 and not parent.children:
                self._push(parent)
        return freed

    def clear(self) -> int:
        """Evict every unreferenced node -> slots freed."""
        return self.evict(self.evictable)
