"""The paged KV cache's bookkeeping: a pool of fixed-size blocks and each request's block list.

Pure Python: the KV tensors themselves live in the model runner, addressed by the block ids
handed out here. Block 0 is never handed out: padded block tables and padding tokens point
at it, so writes meant for nobody land somewhere harmless.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

NULL_BLOCK_ID = 0


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


@dataclass
class KVBlock:
    """One block of ``block_size`` token slots in every layer's KV tensor."""

    block_id: int
    ref_cnt: int = 0


class BlockPool:
    """Free list and reference counts of the KV blocks."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.blocks[NULL_BLOCK_ID].ref_cnt = 1  # pinned forever
        self._free: deque[int] = deque(range(1, num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that requests can ever hold (all but the null block)."""
        return self.num_blocks - 1

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks, each with one reference. The caller checked there are enough."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks with {len(self._free)} free")
        ids = [self._free.popleft() for _ in range(n)]
        for i in ids:
            self.blocks[i].ref_cnt = 1
        return ids

    def incref(self, block_ids: list[int]) -> None:
        """Share blocks with one more holder."""
        for i in block_ids:
            self.blocks[i].ref_cnt += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; blocks nobody holds go back to the free list."""
        for i in block_ids:
            block = self.blocks[i]
            if block.ref_cnt <= 0 or i == NULL_BLOCK_ID:
                raise RuntimeError(f"KV block {i} freed more often than allocated")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free.append(i)


class KVCacheManager:
    """Which blocks each request holds; grows a request's blocks as its tokens are scheduled."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.req_blocks: dict[str, list[int]] = {}

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

    def allocate_slots(self, request_id: str, num_total_tokens: int) -> list[int] | None:
        """Make room for ``num_total_tokens`` tokens of a request.

        Returns the newly added block ids (possibly none), or None when the pool has too few
        free blocks; then nothing changed.
        """
        blocks = self.req_blocks.setdefault(request_id, [])
        need = self.blocks_needed(num_total_tokens) - len(blocks)
        if need <= 0:
            return []
        if need > self.pool.num_free_blocks:
            if not blocks:
                del self.req_blocks[request_id]
            return None
        new = self.pool.allocate(need)
        blocks.extend(new)
        return new

    def free(self, request_id: str) -> None:
        """Give back every block of a request (finished, aborted or preempted)."""
        blocks = self.req_blocks.pop(request_id, None)
        if blocks:
            # Reversed, so that the tail blocks (least likely to be shared) are reused first.
            self.pool.free(blocks[::-1])
