"""Prefix caching and copy-on-write in the KV bookkeeping and the scheduler: no model, no torch."""

from __future__ import annotations

import dataclasses

from test_scheduler import EOS, fake_run, make_request, make_scheduler, run_to_end

from tokenmill.core.kv_cache import KVCacheManager, hash_block
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams

BS = 4


def tokens(n: int, start: int = 10) -> list[int]:
    return list(range(start, start + n))


def computed(kv: KVCacheManager, rid: str, ids: list[int]) -> list[int]:
    """Give ``rid`` blocks for ``ids`` as if a step had computed them all, and register them."""
    blocks = kv.allocate_new(rid, kv.find_cached_prefix(rid, ids), len(ids), len(ids))
    assert blocks is not None
    kv.register_computed(rid, ids, len(ids))
    return blocks


def test_hashes_chain_over_the_whole_prefix() -> None:
    a = hash_block(None, [1, 2, 3, 4])
    assert a == hash_block(None, [1, 2, 3, 4]) != hash_block(None, [1, 2, 3, 5])
    # The same block after different prefixes is a different block.
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(hash_block(None, [0, 2, 3, 4]), [5, 6, 7, 8])


def test_hits_are_whole_blocks_of_the_longest_shared_prefix() -> None:
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    a = computed(kv, "a", tokens(22))  # 5 full blocks registered, 1 partial
    assert kv.pool.num_cached_blocks == 5
    # 13 shared tokens, then different: 3 whole blocks.
    assert kv.find_cached_prefix("b", tokens(13) + [999] * 9) == a[:3]
    # Identical prompt: every full block except one that would hold the last token.
    assert kv.find_cached_prefix("c", tokens(20)) == a[:4]
    assert kv.find_cached_prefix("d", tokens(21)) == a[:5]
    assert kv.find_cached_prefix("e", [999] + tokens(21)[1:]) == []


def test_hit_blocks_are_shared_and_counted() -> None:
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    a = computed(kv, "a", tokens(16))
    b = kv.allocate_new("b", kv.find_cached_prefix("b", tokens(18)), 18, 18)
    assert b is not None and b[:4] == a and b[4] not in a
    assert [kv.pool.blocks[i].ref_cnt for i in a] == [2, 2, 2, 2]
    assert (kv.prefix_stats.queries, kv.prefix_stats.hits) == (16 + 18, 16)
    assert abs(kv.prefix_stats.hit_rate - 16 / 34) < 1e-9


def test_freed_blocks_stay_hits_until_evicted_least_recently_used_first() -> None:
    kv = KVCacheManager(num_blocks=9, block_size=BS)  # 8 usable
    a = computed(kv, "a", tokens(12))  # 3 registered blocks
    kv.free("a")
    assert kv.pool.num_free_blocks == 8 and kv.pool.num_cached_blocks == 3
    # A hit on a free block takes it back out of the free list.
    hits = kv.find_cached_prefix("b", tokens(13))
    assert hits == a
    assert kv.allocate_new("b", hits, 13) is not None
    assert kv.pool.num_free_blocks == 4
    kv.free("b")
    # Unregistered blocks go first; then the least recently freed registered ones.
    fresh = kv.allocate_new("c", [], 5 * BS)
    assert fresh is not None and not set(fresh) & set(a)
    assert kv.find_cached_prefix("d", tokens(13)) == a
    evicting = kv.allocate_new("e", [], 2 * BS)
    assert evicting is not None and len(set(evicting) & set(a)) == 2
    # The tail blocks went first (freed first), the head block is still a hit.
    assert kv.find_cached_prefix("f", tokens(13)) == a[:1]


def test_cannot_start_when_hits_would_eat_the_free_blocks() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=BS)  # 4 usable
    a = computed(kv, "a", tokens(8))
    kv.free("a")
    hits = kv.find_cached_prefix("b", tokens(9))
    assert hits == a
    # 2 hits + 3 fresh blocks > 4 free: refused, and nothing changed.
    assert kv.allocate_new("b", hits, 20) is None
    assert kv.pool.num_free_blocks == 4 and "b" not in kv.req_blocks
    assert kv.allocate_new("b", hits, 16) is not None


def test_fork_shares_then_copies_on_write() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    parent = computed(kv, "p", tokens(10))  # blocks: 2 full + 1 partial
    kv.fork("p", "c", 10)
    assert kv.get_block_ids("c") == parent
    assert [kv.pool.blocks[i].ref_cnt for i in parent] == [2, 2, 2]
    # The child writes position 9 (recomputing the last prompt token): its block is copied.
    allocation = kv.allocate_slots("c", 10, 9)
    assert allocation is not None and allocation.new_block_ids == []
    child = kv.get_block_ids("c")
    assert child[:2] == parent[:2] and child[2] not in parent
    assert allocation.copies == [(parent[2], child[2])] and allocation.rewritten
    assert [kv.pool.blocks[i].ref_cnt for i in parent] == [2, 2, 1]
    # Its copy is private now: writing it again copies nothing.
    again = kv.allocate_slots("c", 10, 9)
    assert again is not None and again.copies == [] and not again.rewritten
    assert kv.get_block_ids("c") == child
    # The parent writes on into its own block: nothing to copy.
    allocation = kv.allocate_slots("p", 11, 10)
    assert allocation is not None and allocation.new_block_ids == [] and allocation.copies == []
    kv.free("c")
    kv.free("p")
    assert kv.pool.num_free_blocks == 15


def test_disabled_caching_finds_nothing() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    computed(kv, "a", tokens(12))
    assert kv.find_cached_prefix("b", tokens(12)) == []
    assert kv.pool.num_cached_blocks == 0 and kv.prefix_stats.queries == 0


# ------------------------------------------------------------------------------ scheduler


def test_second_request_skips_the_cached_prefix() -> None:
    sched = make_scheduler(prefix_caching=True)
    sched.add_request(make_request("a", 18, max_tokens=2))
    run_to_end(sched)
    sched.add_request(make_request("b", 18, max_tokens=2))
    out = sched.schedule()
    # 4 of the 18 prompt tokens' blocks are hits (16 tokens); the last 2 are computed.
    assert out.num_scheduled_tokens == {"b": 2}
    assert out.new_requests[0].num_computed_tokens == 16
    assert sched.stats().prefix_cache_hits_total == 16
    assert sched.stats().prefix_cache_queries_total == 36


def test_outputs_equal_with_and_without_caching_under_preemption() -> None:
    def run(prefix_caching: bool) -> dict[str, list[int]]:
        sched = make_scheduler(num_blocks=14, budget=16, prefix_caching=prefix_caching)
        for i in range(6):
            sched.add_request(make_request(f"r{i}", 9 + i, max_tokens=12))
        outs = run_to_end(sched)
        assert sched.kv.pool.num_free_blocks == 13
        return outs

    assert run(True) == run(False)


def test_prompt_logprobs_requests_compute_every_token() -> None:
    sched = make_scheduler(prefix_caching=True)
    sched.add_request(make_request("a", 12, max_tokens=1))
    run_to_end(sched)
    sched.add_request(make_request("b", 12, max_tokens=1, prompt_logprobs=1))
    assert sched.schedule().num_scheduled_tokens == {"b": 12}


def _samples(n: int, prompt_len: int, max_tokens: int = 4) -> list[Request]:
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens)
    prompt = tokens(prompt_len)
    return [Request(f"r#{i}", prompt, dataclasses.replace(params), frozenset({EOS}),
                    fork_of="r#0" if i else None) for i in range(n)]


def test_samples_fork_the_first_ones_prompt_blocks() -> None:
    for caching in (False, True):
        sched = make_scheduler(prefix_caching=caching)
        for r in _samples(4, 10):
            sched.add_request(r)
        out = sched.schedule()
        assert out.num_scheduled_tokens == {"r#0": 10}  # the others wait for its prompt
        sched.update(out, fake_run(sched, out))
        out = sched.schedule()
        assert out.num_scheduled_tokens == {"r#0": 1, "r#1": 1, "r#2": 1, "r#3": 1}
        leader = sched.kv.get_block_ids("r#0")
        for i in (1, 2, 3):
            blocks = sched.kv.get_block_ids(f"r#{i}")
            assert blocks[:2] == leader[:2] and blocks[2] != leader[2]
        # The prompt's 3 blocks once, plus one copy of the last per other sample.
        assert sched.kv.pool.num_usable_blocks - sched.kv.pool.num_free_blocks == 3 + 3
        assert [sched.kv.pool.blocks[b].ref_cnt for b in leader] == [4, 4, 1]
        assert sorted(dst for _, dst in out.kv_copies) == sorted(
            sched.kv.get_block_ids(f"r#{i}")[2] for i in (1, 2, 3))
        assert all(src == leader[2] for src, _ in out.kv_copies)
        sched.update(out, fake_run(sched, out))
        run_to_end(sched)
        assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_usable_blocks


def test_samples_start_on_their_own_when_the_first_is_gone() -> None:
    sched = make_scheduler()
    for r in _samples(2, 10):
        sched.add_request(r)
    out = sched.schedule()
    sched.update(out, fake_run(sched, out))
    sched.finish_requests(["r#0"], make_request("x", 1).status.FINISHED_ABORTED)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"r#1": 10}
