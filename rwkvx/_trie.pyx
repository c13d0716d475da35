# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Greedy longest-match tokenisation over a byte trie (the World tokenizer's rule, see rwkvx.tokenizer).

Layout, chosen so a match touches little memory: nodes are numbered breadth-first (0 is the root), so
the children of a node are consecutive ids ``first[u] .. first[u] + count[u] - 1`` in byte order and
only their edge bytes (``label``) need storing; ``token[u]`` is the id of the entry ending at ``u``, or
-1. Every match starts with the first two levels, so they are also dense tables. (The World vocabulary
is 116k nodes: about 1.3 MB.) The trie is built through a temporary hash table keyed by (node, byte).
"""
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint64_t

import numpy as np

cdef uint64_t _GOLDEN = 0x9E3779B97F4A7C15ULL  # Fibonacci hashing: spreads consecutive keys


cdef int32_t _hash_child(int64_t[::1] keys, int32_t[::1] children, int shift, int32_t* n_nodes,
                         int32_t node, uint8_t byte):
    """The child of ``node`` along ``byte`` in the build table, inserted as node ``n_nodes`` if new."""
    cdef int64_t key = <int64_t>node * 256 + byte
    cdef uint64_t mask = keys.shape[0] - 1
    cdef uint64_t slot = (<uint64_t>key * _GOLDEN) >> shift
    while keys[slot] != -1:
        if keys[slot] == key:
            return children[slot]
        slot = (slot + 1) & mask
    keys[slot] = key
    children[slot] = n_nodes[0]
    n_nodes[0] += 1
    return n_nodes[0] - 1


cdef class ByteTrie:
    """A trie of byte strings with token ids < 65536; :meth:`encode` splits bytes into the longest
    entries, left to right. ``max_len`` is the longest entry's length: all one match reads."""

    cdef int32_t[::1] first
    cdef int32_t[::1] count
    cdef uint8_t[::1] label
    cdef int32_t[::1] token
    cdef int32_t[::1] level1    # node of each 1-byte prefix, -1 = none
    cdef int32_t[::1] level2    # node of each 2-byte prefix (first byte * 256 + second), -1 = none
    cdef readonly int max_len

    def __init__(self, entries):
        """``entries``: (bytes, id) pairs, each byte string non-empty and unique, 0 <= id < 65536."""
        entries = list(entries)
        cdef Py_ssize_t total = sum(len(b) for b, _ in entries), i
        cdef int bits = 4
        while (1 << bits) < 2 * (total + 1):
            bits += 1
        keys_arr = np.full(1 << bits, -1, dtype=np.int64)
        children_arr = np.zeros(1 << bits, dtype=np.int32)
        cdef int64_t[::1] keys = keys_arr
        cdef int32_t[::1] children = children_arr
        tokens_arr = np.full(total + 1, -1, dtype=np.int32)
        cdef int32_t[::1] tokens = tokens_arr
        cdef int32_t n_nodes = 1, node
        cdef const uint8_t[:] raw
        self.max_len = 0
        for data, tid in entries:
            if not isinstance(data, bytes) or not data:
                raise ValueError(f"trie entries must be non-empty bytes, got {data!r}")
            if not 0 <= tid < 65536:
                raise ValueError(f"token id {tid} of {data!r} is outside [0, 65536)")
            raw = data
            node = 0
            for i in range(raw.shape[0]):
                node = _hash_child(keys, children, 64 - bits, &n_nodes, node, raw[i])
            if tokens[node] >= 0:
                raise ValueError(f"duplicate trie entry {data!r} (ids {tokens[node]} and {tid})")
            tokens[node] = tid
            self.max_len = max(self.max_len, raw.shape[0])
        self._renumber(keys_arr, children_arr, tokens_arr[:n_nodes])

    def _renumber(self, keys, children, tokens):
        """Lay the build table's nodes out breadth-first (see the module docstring)."""
        used = keys != -1
        parent, byte, child = keys[used] >> 8, (keys[used] & 255).astype(np.uint8), children[used]
        order = np.lexsort((byte, parent))               # edges grouped by parent, in byte order
        parent, byte, child = parent[order], byte[order], child[order]
        n = tokens.shape[0]
        start = np.searchsorted(parent, np.arange(n + 1))
        cdef int64_t[::1] st = start
        cdef int32_t[::1] ch = child
        new_arr = np.zeros(n, dtype=np.int32)
        queue_arr = np.zeros(n, dtype=np.int32)          # old ids in breadth-first order
        cdef int32_t[::1] new = new_arr, queue = queue_arr
        cdef Py_ssize_t head, tail = 1, e
        cdef int32_t u
        for head in range(n):
            u = queue[head]
            for e in range(st[u], st[u + 1]):
                new[ch[e]] = tail
                queue[tail] = ch[e]
                tail += 1
        counts = np.diff(start).astype(np.int32)
        has = np.flatnonzero(counts)                     # old ids of the nodes with children
        first = np.zeros(n, dtype=np.int32)
        first[new_arr[has]] = new_arr[child[start[has]]]
        label = np.zeros(n, dtype=np.uint8)
        label[new_arr[child]] = byte
        self.first, self.count, self.label = first, counts[queue_arr], label
        self.token = np.ascontiguousarray(tokens[queue_arr])
        self.level1 = np.full(256, -1, dtype=np.int32)
        self.level2 = np.full(65536, -1, dtype=np.int32)
        cdef Py_ssize_t b, c
        for b in range(self.count[0]):
            u = self.first[0] + b
            self.level1[self.label[u]] = u
            for c in range(self.count[u]):
                self.level2[self.label[u] * 256 + self.label[self.first[u] + c]] = self.first[u] + c

    cdef inline int32_t _child(self, int32_t node, uint8_t byte) noexcept nogil:
        """The child of ``node`` along ``byte``, or -1."""
        cdef int32_t c = self.first[node], end = c + self.count[node]
        while c < end:
            if self.label[c] >= byte:
                return c if self.label[c] == byte else -1
            c += 1
        return -1

    def encode(self, const uint8_t[:] data, bint final=True):
        """``(ids, consumed)``: uint16 ids of ``data[:consumed]``, matched greedily longest-first.

        With ``final`` false, matching stops where fewer than :attr:`max_len` bytes remain, since more
        input could still lengthen the match: pass ``data[consumed:]`` in front of the next chunk.
        ``ValueError`` names the offset of a byte that starts no entry."""
        cdef Py_ssize_t n = data.shape[0], pos = 0, j, best_len, k = 0
        cdef int32_t node, best
        out_arr = np.empty(n, dtype=np.uint16)
        cdef uint16_t[::1] out = out_arr
        with nogil:
            while pos < n and (final or pos + self.max_len <= n):
                best, best_len = -1, 0
                node = self.level1[data[pos]]
                if node >= 0:
                    if self.token[node] >= 0:
                        best, best_len = self.token[node], 1
                    j = pos + 1
                    node = self.level2[data[pos] * 256 + data[j]] if j < n else -1
                    while node >= 0:
                        j += 1
                        if self.token[node] >= 0:
                            best, best_len = self.token[node], j - pos
                        node = self._child(node, data[j]) if j < n else -1
                if best < 0:
                    break
                out[k] = <uint16_t>best
                k += 1
                pos += best_len
        if pos < n and (final or pos + self.max_len <= n):
            raise ValueError(f"byte {data[pos]:#04x} at offset {pos} starts no vocabulary entry")
        return out_arr[:k], pos
