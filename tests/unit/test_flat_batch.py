"""FlatBatch.build: the step's ids, positions, slots, query starts, lengths and block table,
cut as views from two host tensors, each equal to what the sequences added say."""

from __future__ import annotations

import torch

from tokenmill.runner.flat_batch import FlatBatch

CPU = torch.device("cpu")


def test_two_sequences_and_their_metadata() -> None:
    batch = FlatBatch(16)
    assert batch.add([5, 6, 7], 0, [3]) == 0
    assert batch.add([9], 20, [1, 2]) == 3
    ids, positions, meta = batch.build(None, [], CPU)  # type: ignore[arg-type]
    assert ids.tolist() == [5, 6, 7, 9] and ids.dtype == torch.int64
    assert positions.tolist() == [0, 1, 2, 20]
    assert meta.slot_mapping.tolist() == [48, 49, 50, 2 * 16 + 4]
    assert meta.query_start_loc.tolist() == [0, 3, 4]
    assert meta.seq_lens.tolist() == [3, 21] and meta.seq_lens.dtype == torch.int32
    assert meta.block_tables.tolist() == [[3, 0], [1, 2]]
    assert meta.block_tables.dtype == torch.int32
    for t in (ids, positions, meta.slot_mapping, meta.query_start_loc, meta.seq_lens,
              meta.block_tables):
        assert t.is_contiguous()
    # In-place changes to one view (the draft proposer advances positions) leave the others.
    positions += 1
    assert ids.tolist() == [5, 6, 7, 9] and meta.slot_mapping.tolist()[0] == 48


def test_split_sequences_and_a_large_table() -> None:
    """One-token sequences over shared blocks (--deterministic), and a table past the size
    where it is padded through numpy."""
    batch = FlatBatch(4)
    batch.add([1, 2], 5, [7, 8], split=True)
    _, _, meta = batch.build(None, [], CPU)  # type: ignore[arg-type]
    assert meta.query_start_loc.tolist() == [0, 1, 2]
    assert meta.seq_lens.tolist() == [6, 7]
    assert meta.block_tables.tolist() == [[7, 8], [7, 8]]
    big = FlatBatch(16)
    tables = [list(range(i, i + 300 + 10 * i)) for i in range(8)]  # 2,680 ids, ragged
    for i, t in enumerate(tables):
        big.add([i], 16 * len(t) - 1, t)
    ids, _, meta = big.build(None, [], CPU)  # type: ignore[arg-type]
    width = max(len(t) for t in tables)
    assert meta.block_tables.shape == (8, width)
    assert meta.block_tables.tolist() == [t + [0] * (width - len(t)) for t in tables]
    assert meta.seq_lens.tolist() == [16 * len(t) for t in tables]
    assert ids.tolist() == list(range(8))


def test_an_empty_step() -> None:
    ids, positions, meta = FlatBatch(16).build(None, [], CPU)  # type: ignore[arg-type]
    assert ids.numel() == positions.numel() == meta.slot_mapping.numel() == 0
    assert meta.query_start_loc.tolist() == [0]
    assert meta.block_tables.shape == (0, 0)
