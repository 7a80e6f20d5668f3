import pytest

from pipefill.kv.cache import token_slots
from pipefill.kv.pool import OutOfPages, PagePool
from pipefill.base.partition import partition_layers


def test_pool_refcounts_and_integrity():
    pool = PagePool(8)
    a = pool.allocate(3)
    assert a == [0, 1, 2]  # low ids first: consecutive pages
    pool.retain(a[:1])
    pool.release(a)
    assert pool.num_free == 7
    pool.release(a[:1])
    pool.check_integrity()
    assert pool.num_free == 8
    with pytest.raises(OutOfPages):
        pool.allocate(9)
    with pytest.raises(AssertionError):
        pool.release([0])


def test_borrowed_pages_come_back_unannounced():
    pool = PagePool(8)
    owned = pool.allocate(2)
    pool.release(owned[1:])
    pool.drain_freed()
    lent = pool.borrow(3)
    assert lent == [1, 2, 3] and pool.num_free == 4
    pool.give_back(lent)
    pool.check_integrity()
    assert pool.freed == [] and pool.num_free == 7  # no stage hears of a borrow
    assert pool.allocate(3) == lent  # the free list is as it was before the borrow
    with pytest.raises(AssertionError):
        pool.give_back([owned[0], owned[0]])  # a page given back twice


def test_token_slots_slice_when_consecutive():
    assert token_slots([4, 5, 6], 3, 40, 16) == slice(67, 104)
    slots = token_slots([4, 9], 14, 18, 16)
    assert slots.tolist() == [78, 79, 144, 145]


def test_default_partition_gives_remainder_to_last_stages():
    assert [len(r) for r in partition_layers(30, 4)] == [7, 7, 8, 8]
    assert [len(r) for r in partition_layers(7, 3)] == [2, 2, 3]
    assert partition_layers(4, 1) == [range(0, 4)]


@pytest.mark.parametrize("text, match", [
    ("1,2", "2 entries but --pp-size is 3"), ("1,1,1", "sums to 3"), ("0,3,4", "at least one"),
    ("a,b,c", "comma-separated integers")])
def test_bad_partitions_say_what_to_change(text, match):
    with pytest.raises(ValueError, match=match):
        partition_layers(7, 3, text)


def test_more_stages_than_layers():
    with pytest.raises(ValueError, match="at most 4 stages"):
        partition_layers(4, 5)


def test_costs_balance_the_stages_and_equal_costs_keep_the_even_rule():
    from pipefill.base.partition import balanced_counts
    # Three dense layers (cost 3) ahead of eight sparse ones (cost 1), as DeepSeek-V3 starts.
    costs = [3.0] * 3 + [1.0] * 8
    ranges = partition_layers(11, 3, costs=costs)
    assert [len(r) for r in ranges] == [2, 3, 6]  # by count it would be 3, 4, 4
    assert [sum(costs[r.start:r.stop]) for r in ranges] == [6, 5, 6]  # 6 is the least maximum
    assert [len(r) for r in partition_layers(10, 4, costs=[2.0] * 10)] == [2, 2, 3, 3]
    assert [len(r) for r in partition_layers(10, 4, "1,2,3,4", costs=costs[:10])] == [1, 2, 3, 4]
    # Ties go to later stages: 4 equal-cost layers after a heavy one, 2 stages.
    assert balanced_counts([4.0, 1.0, 1.0, 1.0, 1.0], 2) == [1, 4]
