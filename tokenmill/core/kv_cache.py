"""The paged KV cache's bookkeeping: a pool of fixed-size blocks and each request's block list.

Pure Python: the KV tensors themselves live in the model runner, addressed by the block ids
handed out here. Block 0 is never handed out: padded block tables and padding tokens point
at it, so writes meant for nobody land somewhere harmless.

Prefix caching: once a block is full of computed tokens it is registered under a hash chained
over every token up to its end, so a later request whose tokens start the same way takes the
block instead of computing it again. Freed blocks stay registered until their slot is needed:
the free list is an LRU, and a registered block is evicted (its hash forgotten) only when it
is handed out again.

Copy-on-write: ``fork`` lets a request share another's blocks (n > 1 samples of one prompt);
a write into a block that more than one request holds first moves the writer to a copy, and
``allocate_slots`` returns the copies the runner must make (``SlotAllocation.copies``).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from tokenmill.core.kv_events import AllBlocksCleared, BlockRemoved, KVCacheEvent, stored_events
from tokenmill.utils import cdiv

# Never handed out (see above). Counts of blocks against tokens go through the two helpers
# below, so that this rule is written once.
NULL_BLOCK_ID = 0


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks a KV cache needs to hold one sequence of ``num_tokens`` tokens: the sequence's
    own blocks plus the reserved null block."""
    return cdiv(num_tokens, block_size) + 1


def tokens_in_blocks(num_blocks: int, block_size: int) -> int:
    """Tokens a KV cache of ``num_blocks`` blocks holds at once (the null block holds none)."""
    return (num_blocks - 1) * block_size

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """The hash of a full block: its tokens chained to the hash of the block before it, so equal
    hashes mean equal prefixes (a cryptographic hash: prompts of other users cannot be made to
    collide with a cached prefix)."""
    h = hashlib.blake2b(digest_size=16)
    if parent is not None:
        h.update(parent)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


@dataclass
class KVBlock:
    """One block of ``block_size`` token slots in every layer's KV tensor."""

    block_id: int
    ref_cnt: int = 0
    # Set while the block is registered in the prefix cache.
    block_hash: BlockHash | None = None


class BlockPool:
    """Reference counts, the LRU free list and the prefix cache's hash -> block map."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.blocks[NULL_BLOCK_ID].ref_cnt = 1  # pinned forever
        # Unreferenced blocks, the next to hand out first. Registered ones are still cache hits.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self._cached: dict[BlockHash, int] = {}
        # Changes of the prefix cache since they were last taken (kv_events.py); None: off.
        self.events: list[KVCacheEvent] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (unreferenced, registered or not)."""
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that requests can ever hold (all but the null block)."""
        return self.num_blocks - 1

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks, each with one reference, evicting the least recently used
        registered ones. The caller checked there are enough."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks with {len(self._free)} free")
        ids = [self._free.popitem(last=False)[0] for _ in range(n)]
        for i in ids:
            block = self.blocks[i]
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                if self.events is not None:
                    self.events.append(BlockRemoved([block.block_hash]))
                block.block_hash = None
            block.ref_cnt = 1
        return ids

    def incref(self, block_ids: list[int]) -> None:
        """Share blocks with one more holder (a fork, or a prefix-cache hit)."""
        for i in block_ids:
            block = self.blocks[i]
            if block.ref_cnt == 0:
                del self._free[i]
            block.ref_cnt += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block. Blocks nobody holds become free: registered ones at
        the most-recently-used end (kept as long as possible), the others first in line."""
        for i in block_ids:
            block = self.blocks[i]
            if block.ref_cnt <= 0 or i == NULL_BLOCK_ID:
                raise RuntimeError(f"KV block {i} freed more often than allocated")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[i] = None
                if block.block_hash is None:
                    self._free.move_to_end(i, last=False)

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self._cached.get(block_hash)

    def register(self, block_id: int, block_hash: BlockHash) -> bool:
        """Make a full block a cache hit for ``block_hash``; whether it became one. If another
        block already holds the same content, that one stays the hit and this one is left
        unregistered."""
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block_id
        return True

    def reset_prefix_cache(self) -> None:
        """Forget every registered hash (e.g. after the weights changed)."""
        for block_id in self._cached.values():
            self.blocks[block_id].block_hash = None
        self._cached.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared())


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up in the prefix cache and those found, since the start."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass(frozen=True)
class SlotAllocation:
    """What ``allocate_slots`` changed in one request's block list."""

    # Blocks appended to the end of the list (possibly none).
    new_block_ids: list[int]
    # (source, destination) blocks the runner must copy, in every layer, before the step
    # writes: shared blocks in the written range that the request now holds a private copy of.
    copies: list[tuple[int, int]]

    @property
    def rewritten(self) -> bool:
        """Whether blocks inside the list were swapped for copies (not only appended to)."""
        return bool(self.copies)


class KVCacheManager:
    """Which blocks each request holds; grows a request's blocks as its tokens are scheduled."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 enable_kv_events: bool = False) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        if enable_kv_events:
            self.pool.events = []
        self.req_blocks: dict[str, list[int]] = {}
        # Per request: hashes of its full blocks of tokens so far (kept across preemption: the
        # tokens only grow), and how many of its held blocks are registered.
        self._hashes: dict[str, list[BlockHash]] = {}
        # Per request whose KV depends on more than its tokens (a LoRA adapter): what its
        # first block's hash is chained to.
        self._salts: dict[str, bytes] = {}
        # Each adapter request's lora_int_id (for its KV events).
        self._lora_ids: dict[str, int] = {}
        self._num_registered: dict[str, int] = {}
        self.prefix_stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests."""
        pool = self.pool
        return 1.0 - pool.num_free_blocks / pool.num_usable_blocks

    @property
    def max_num_tokens(self) -> int:
        """How many tokens the whole cache can hold at once."""
        return self.pool.num_usable_blocks * self.block_size

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether one request of ``num_tokens`` tokens fits in the cache when alone."""
        return self.blocks_needed(num_tokens) <= self.pool.num_usable_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.req_blocks.get(request_id, [])

    # ------------------------------------------------------------------ prefix caching

    def set_salt(self, request_id: str, salt: bytes, lora_id: int | None = None) -> None:
        """Chain the request's block hashes to ``salt``: its blocks are hits only for requests
        with the same salt (the same adapter), before any of its hashes is computed.
        ``lora_id``: the adapter's id, named in the KV events of the request's blocks."""
        self._salts[request_id] = salt
        if lora_id is not None:
            self._lora_ids[request_id] = lora_id

    def block_hashes(self, request_id: str, token_ids: Sequence[int],
                     num_blocks: int) -> list[BlockHash]:
        """Hashes of the first ``num_blocks`` full blocks of ``token_ids`` (memoized)."""
        hashes = self._hashes.setdefault(request_id, [])
        bs = self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else self._salts.get(request_id)
            hashes.append(hash_block(parent, token_ids[i * bs:(i + 1) * bs]))
        return hashes[:num_blocks]

    def find_cached_prefix(self, request_id: str, token_ids: Sequence[int]) -> list[int]:
        """Blocks that hold the longest cached prefix of ``token_ids``, whole blocks only and
        never the last token (whose logits the step must compute)."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (len(token_ids) - 1) // self.block_size
        hits: list[int] = []
        for h in self.block_hashes(request_id, token_ids, max_blocks):
            block_id = self.pool.lookup(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def allocate_new(self, request_id: str, cached_blocks: list[int], num_tokens: int,
                     num_prompt_tokens: int | None = None) -> list[int] | None:
        """Start a request's blocks: ``cached_blocks`` (from ``find_cached_prefix``) plus fresh
        ones up to ``num_tokens`` tokens. None, changing nothing, when too few are free.
        ``num_prompt_tokens``, when given, counts the lookup in ``prefix_stats``."""
        need = self.blocks_needed(num_tokens) - len(cached_blocks)
        # Hits that sit in the free list stop being free when taken.
        revived = sum(1 for b in cached_blocks if self.pool.blocks[b].ref_cnt == 0)
        if need > self.pool.num_free_blocks - revived:
            return None
        self.pool.incref(cached_blocks)
        blocks = cached_blocks + self.pool.allocate(max(need, 0))
        self.req_blocks[request_id] = blocks
        self._num_registered[request_id] = len(cached_blocks)
        if num_prompt_tokens is not None and self.enable_prefix_caching:
            self.prefix_stats.queries += num_prompt_tokens
            self.prefix_stats.hits += len(cached_blocks) * self.block_size
        return blocks

    def register_computed(self, request_id: str, token_ids: Sequence[int],
                          num_computed_tokens: int) -> None:
        """Register the request's blocks that ``num_computed_tokens`` computed tokens fill.
        Called once the step that computed them has run (so that no one can hit a block whose
        KV is not written yet, and rejected speculative tokens are never registered)."""
        if not self.enable_prefix_caching or request_id not in self.req_blocks:
            return
        blocks = self.req_blocks[request_id]
        full = min(num_computed_tokens // self.block_size, len(blocks))
        start = self._num_registered.get(request_id, 0)
        if full <= start:
            return
        hashes = self.block_hashes(request_id, token_ids, full)
        stored = [i for i in range(start, full) if self.pool.register(blocks[i], hashes[i])]
        self._num_registered[request_id] = full
        if self.pool.events is not None and stored:
            self.pool.events += stored_events(stored, hashes, self._salts.get(request_id),
                                              token_ids, self.block_size,
                                              self._lora_ids.get(request_id))

    def take_events(self) -> list[KVCacheEvent]:
        """The prefix cache's changes since the last call (none when events are off)."""
        events = self.pool.events
        if not events:
            return []
        self.pool.events = []
        return events

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
        self._num_registered = dict.fromkeys(self._num_registered, 0)

    # ------------------------------------------------------------------ copy-on-write

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> None:
        """Let ``child_id`` share the blocks of ``parent_id`` that hold its first ``num_tokens``
        tokens; the first write into a shared block copies it (see ``allocate_slots``)."""
        shared = self.req_blocks[parent_id][:self.blocks_needed(num_tokens)]
        self.pool.incref(shared)
        self.req_blocks[child_id] = list(shared)
        self._num_registered[child_id] = min(self._num_registered.get(parent_id, 0), len(shared))

    # ------------------------------------------------------------------ growing and freeing

    def allocate_slots(self, request_id: str, num_total_tokens: int,
                       num_computed_tokens: int | None = None) -> SlotAllocation | None:
        """Make room for ``num_total_tokens`` tokens of a request, whose tokens from
        ``num_computed_tokens`` on are written in the coming step.

        Returns the blocks added and copied, or None when the pool has too few free blocks;
        then nothing changed. Shared blocks that the step writes into are swapped for private
        copies first (``num_computed_tokens`` given).
        """
        blocks = self.req_blocks.setdefault(request_id, [])
        need = max(self.blocks_needed(num_total_tokens) - len(blocks), 0)
        shared = []
        if num_computed_tokens is not None:
            first = num_computed_tokens // self.block_size
            last = min(self.blocks_needed(num_total_tokens), len(blocks))
            shared = [i for i in range(first, last) if self.pool.blocks[blocks[i]].ref_cnt > 1]
        if need + len(shared) > self.pool.num_free_blocks:
            if not blocks:
                del self.req_blocks[request_id]
            return None
        copies = []
        for i in shared:
            (copy,) = self.pool.allocate(1)
            copies.append((blocks[i], copy))
            self.pool.free([blocks[i]])
            blocks[i] = copy
            # The copy is private: registering it again would only duplicate the original.
            self._num_registered[request_id] = min(self._num_registered.get(request_id, 0), i)
        new = self.pool.allocate(need) if need else []
        blocks.extend(new)
        return SlotAllocation(new, copies)

    def free(self, request_id: str) -> None:
        """Give back every block of a request (finished, aborted or preempted)."""
        blocks = self.req_blocks.pop(request_id, None)
        self._num_registered.pop(request_id, None)
        if blocks:
            # Reversed, so that the tail blocks (least likely to be shared) are reused first.
            self.pool.free(blocks[::-1])

    def forget(self, request_id: str) -> None:
        """Drop what is kept about a finished request beyond its blocks (its hashes)."""
        self._hashes.pop(request_id, None)
        self._salts.pop(request_id, None)
        self._lora_ids.pop(request_id, None)


class NoKVCache(KVCacheManager):
    """The KV bookkeeping of an engine whose model keeps no KV cache (an encoder: each
    request is computed whole in one step and attends only within that step).

    Every request fits and holds no blocks, so the scheduler runs unchanged: its budget of
    tokens per step and of sequences is then the only limit.
    """

    def __init__(self, block_size: int) -> None:
        # The smallest pool the base class accepts; no block of it is ever handed out.
        super().__init__(num_blocks=2, block_size=block_size, enable_prefix_caching=False)

    @property
    def usage(self) -> float:
        return 0.0

    @property
    def max_num_tokens(self) -> int:
        return 0

    def can_ever_fit(self, num_tokens: int) -> bool:
        return True

    def allocate_new(self, request_id: str, cached_blocks: list[int], num_tokens: int,
                     num_prompt_tokens: int | None = None) -> list[int] | None:
        return []

    def allocate_slots(self, request_id: str, num_total_tokens: int,
                       num_computed_tokens: int | None = None) -> SlotAllocation | None:
        return SlotAllocation([], [])

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> None:
        raise RuntimeError("an engine without a KV cache cannot share a prompt's blocks")
