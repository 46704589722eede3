"""StatePool's snapshot eviction: segmented LRU, snapshots a hit resumed from outlasting unused ones."""

from k3ray.engine.core.state_pool import StatePool


def snapshot(pool, key):
    slot = pool.reserve_snapshot(key)
    pool.commit_snapshot(slot)
    return slot


def resume(pool, slot, completed=True):
    pool.pin(slot)
    pool.unpin(slot, resumed=completed)


def held(pool):
    return sorted(pool.valid)


def test_unused_snapshots_go_first_then_the_least_recently_resumed():
    pool = StatePool(3, max_protected=2)
    a, b = snapshot(pool, b"a"), snapshot(pool, b"b")
    resume(pool, a)
    snapshot(pool, b"c")
    snapshot(pool, b"d")  # evicts b (never resumed), not a (older but resumed)
    assert held(pool) == [b"a", b"c", b"d"]
    snapshot(pool, b"e")  # evicts c
    resume(pool, pool.lookup(b"e"))
    snapshot(pool, b"f")  # evicts d; a and e are protected
    assert held(pool) == [b"a", b"e", b"f"]
    resume(pool, pool.lookup(b"f"))  # three protected past the limit of two: a, the oldest, is demoted
    snapshot(pool, b"g")
    assert held(pool) == [b"e", b"f", b"g"]


def test_a_step_that_did_not_complete_protects_nothing():
    pool = StatePool(2, max_protected=1)
    a = snapshot(pool, b"a")
    snapshot(pool, b"b")
    resume(pool, a, completed=False)
    snapshot(pool, b"c")  # a went back unprotected, as the most recently used: c evicts b
    snapshot(pool, b"d")  # and d evicts a
    assert held(pool) == [b"c", b"d"]


def test_with_no_protected_room_eviction_is_plain_lru():
    pool = StatePool(2)
    a = snapshot(pool, b"a")
    snapshot(pool, b"b")
    resume(pool, a)
    snapshot(pool, b"c")  # evicts b, the least recently used
    assert held(pool) == [b"a", b"c"]
    assert not pool.protected and not pool.reused


def test_clearing_frees_both_segments():
    pool = StatePool(3, max_protected=1)
    a = snapshot(pool, b"a")
    snapshot(pool, b"b")
    resume(pool, a)
    pool.clear_snapshots()
    assert pool.num_snapshots == 0 and pool.num_available == 3 and not pool.reused


def test_a_snapshot_of_a_shared_prefix_is_protected_from_its_write_and_forgotten_if_dropped():
    pool = StatePool(3, max_protected=1)
    shared = pool.reserve_snapshot(b"branch", shared=True)
    pool.commit_snapshot(shared)
    snapshot(pool, b"b")
    snapshot(pool, b"c")
    snapshot(pool, b"d")  # evicts b, not the older branch-point snapshot
    assert held(pool) == [b"branch", b"c", b"d"]
    dropped = pool.reserve_snapshot(b"e", shared=True)  # evicts c
    pool.drop_snapshot(dropped)
    assert dropped not in pool.reused and held(pool) == [b"branch", b"d"]


def test_a_run_longer_than_the_slots_keeps_its_snapshots_spread_and_its_newest():
    pool = StatePool(4)
    for position in range(1, 11):
        pool.commit_snapshot(pool.reserve_snapshot(b"%d" % position, run="long", position=position))
    # plain LRU would keep 7, 8, 9, 10; each eviction drops the snapshot whose loss leaves the smallest gap
    assert sorted(int(k) for k in pool.valid) == [4, 7, 9, 10]


def test_the_least_recently_used_run_gives_up_a_snapshot_first():
    pool = StatePool(3)
    for key, run, position in [(b"a1", "a", 1), (b"a2", "a", 2), (b"b1", "b", 1), (b"b2", "b", 2)]:
        pool.commit_snapshot(pool.reserve_snapshot(key, run=run, position=position))
    assert held(pool) == [b"a2", b"b1", b"b2"]  # a's older one, not its newest
    pool.commit_snapshot(pool.reserve_snapshot(b"b3", run="b", position=3))
    assert held(pool) == [b"b1", b"b2", b"b3"]  # a's last one: a run's newest goes only when it is alone
