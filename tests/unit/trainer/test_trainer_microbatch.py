"""Dynamic micro-batching: budget, count near the lower bound, equal work per rank, packing."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.trainer.microbatch import allocate, allocate_for_ranks, fixed_size_batches, pack

CAPACITY = 32768


def baseline_lengths(n: int) -> list[int]:
    """shared/BASELINES.md: lognormal(ln 2000, 1), seed 20240607, clipped to [64, 32768]."""
    rng = np.random.default_rng(20240607)
    return np.clip(rng.lognormal(mean=math.log(2000), sigma=1.0, size=n), 64, 32768).astype(int).tolist()


def _check_partition(bins, n):
    flat = sorted(i for b in bins for i in b)
    assert flat == list(range(n)), "every sequence exactly once"


@pytest.mark.parametrize("n", [512, 8192])
def test_baseline_lengths_within_one_of_lower_bound_and_never_over_budget(n):
    lengths = baseline_lengths(n)
    bins = allocate(lengths, CAPACITY)
    _check_partition(bins, n)
    loads = [sum(lengths[i] for i in b) for b in bins]
    assert max(loads) <= CAPACITY
    lower = math.ceil(sum(lengths) / CAPACITY)
    assert lower <= len(bins) <= lower + 1
    # better balanced than the reference's least-filled micro-batch (19,313 of 32,768 at 8192)
    assert min(loads) > 19_313


@pytest.mark.parametrize("dp", [1, 2, 3, 4, 8])
def test_equal_number_of_micro_batches_per_rank_and_balanced_tokens(dp):
    lengths = baseline_lengths(512)
    ranks = allocate_for_ranks(lengths, CAPACITY, dp)
    assert len(ranks) == dp
    assert len({len(r) for r in ranks}) == 1
    _check_partition([b for r in ranks for b in r], len(lengths))
    loads = [sum(lengths[i] for b in r for i in b) for r in ranks]
    assert max(loads) - min(loads) <= CAPACITY
    assert all(sum(lengths[i] for i in b) <= CAPACITY for r in ranks for b in r)


def test_fewer_sequences_than_ranks_still_gives_every_rank_a_micro_batch():
    ranks = allocate_for_ranks([10, 20, 30], 100, dp_size=4)
    assert [len(r) for r in ranks] == [1, 1, 1, 1]
    _check_partition([b for r in ranks for b in r], 3)


def test_deterministic():
    lengths = baseline_lengths(2000)
    assert allocate_for_ranks(lengths, CAPACITY, 4) == allocate_for_ranks(list(lengths), CAPACITY, 4)
    # ties (equal lengths) are broken by index, not by hash or arrival
    assert allocate([5] * 10, 10) == allocate([5] * 10, 10)


def test_sequence_over_budget_is_a_clear_error():
    with pytest.raises(ValueError, match="sequence 1 has 50 tokens"):
        allocate([10, 50], 40)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 100), min_size=1, max_size=60), st.integers(100, 300), st.integers(1, 4))
def test_property_budget_partition_count(lengths, cap, dp):
    ranks = allocate_for_ranks(lengths, cap, dp)
    bins = [b for r in ranks for b in r]
    _check_partition(bins, len(lengths))
    assert all(sum(lengths[i] for i in b) <= cap for b in bins)
    assert len({len(r) for r in ranks}) == 1
    # a micro-batch is opened only when nothing fits: no two micro-batches could be merged
    loads = sorted(sum(lengths[i] for i in b) for b in allocate(lengths, cap))
    if len(loads) > 1:
        assert loads[0] + loads[1] > cap


def test_fixed_size_baseline_batches():
    assert fixed_size_batches(5, 2) == [[0, 1], [2, 3], [4]]


def test_pack_concatenates_with_boundaries_and_positions():
    seqs = [np.array([1, 2, 3]), np.array([4]), np.array([5, 6])]
    mask = [np.array([0, 1, 1], bool), np.array([1], bool), np.array([0, 1], bool)]
    mb = pack(seqs, {"loss_mask": mask}, seq_index=[7, 8, 9])
    assert mb.input_ids.tolist() == [1, 2, 3, 4, 5, 6]
    assert mb.cu_seqlens.tolist() == [0, 3, 4, 6]
    assert mb.position_ids.tolist() == [0, 1, 2, 0, 0, 1]
    assert mb.fields["loss_mask"].tolist() == [False, True, True, True, False, True]
    assert mb.seq_index == [7, 8, 9] and mb.seqlens() == [3, 1, 2]
    with pytest.raises(ValueError, match="field 'x' of sequence 0"):
        pack(seqs, {"x": [np.zeros(2), np.zeros(1), np.zeros(2)]})
