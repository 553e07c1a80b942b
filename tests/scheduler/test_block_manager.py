"""BlockManager: allocation, ref counts and prefix caching, with plain lists."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import BlockManager, Sequence


def seq(tokens: list[int], rid: str = "r", block_size: int = 4) -> Sequence:
    return Sequence(rid, tokens, max_tokens=8, block_size=block_size)


def check_invariants(bm: BlockManager, live: list[Sequence]) -> None:
    assert len(bm.free_block_ids) + len(bm.used_block_ids) == bm.num_blocks
    assert not set(bm.free_block_ids) & bm.used_block_ids
    assert len(set(bm.free_block_ids)) == len(bm.free_block_ids)
    refs: dict[int, int] = {}
    for s in live:
        for b in s.block_table:
            refs[b] = refs.get(b, 0) + 1
    assert refs == {b.block_id: b.ref_count for b in bm.blocks if b.ref_count}
    assert set(refs) == bm.used_block_ids


def test_prefix_blocks_are_shared_and_verified() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "a")
    bm.allocate(a)
    bm.commit(a, len(a))
    b = seq([1, 2, 3, 4, 5, 6, 7, 8, 10, 11], "b")
    bm.allocate(b)
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    assert [bm.blocks[i].ref_count for i in a.block_table[:2]] == [2, 2]
    c = seq([1, 2, 3, 4, 9, 9, 9, 9, 1], "c")   # same first block, different second
    bm.allocate(c)
    assert c.num_cached_tokens == 4 and c.block_table[1] not in a.block_table
    a_prefix = a.block_table[:2]
    for s in (a, b, c):
        bm.free(s)
    assert bm.num_free_blocks == 10
    d = seq([1, 2, 3, 4, 5, 6, 7, 8, 42], "d")    # cached blocks survive being freed
    bm.allocate(d)
    assert d.num_cached_tokens == 8 and d.block_table[:2] == a_prefix


def test_blocks_holding_images_are_shared_only_with_the_same_images_at_the_same_places() -> None:
    bm = BlockManager(num_blocks=20, block_size=4)
    tokens = [1, 2, 0, 0, 0, 0, 0, 0, 3, 4, 5]   # an image of 6 positions at 2..7 spans blocks 0 and 1

    def image_seq(rid: str, spans: tuple[tuple[int, int, str], ...]) -> Sequence:
        return Sequence(rid, tokens, max_tokens=8, block_size=4, mm_spans=spans)

    a = image_seq("a", ((2, 6, "d1"),))
    assert a.block_media(0) == ((2, 6, "d1"),) and a.block_media(1) == ((-2, 6, "d1"),) and a.block_media(2) == ()
    bm.allocate(a)
    bm.commit(a, len(a))
    same = image_seq("same", ((2, 6, "d1"),))
    bm.allocate(same)
    assert same.num_cached_tokens == 8 and same.block_table[:2] == a.block_table[:2]
    for i, spans in enumerate((((2, 6, "d2"),), ((2, 5, "d1"),), ())):   # another image, another span, none
        other = image_seq(f"other{i}", spans)
        bm.allocate(other)
        assert other.num_cached_tokens == 0 and not set(other.block_table) & set(a.block_table)
        bm.free(other)
    for s in (a, same):
        bm.free(s)
    assert bm.num_free_blocks == bm.num_blocks


def test_last_block_is_always_computed() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8], "a")
    bm.allocate(a)
    bm.commit(a, len(a))
    b = seq([1, 2, 3, 4, 5, 6, 7, 8], "b")
    bm.allocate(b)
    assert b.num_cached_tokens == 4  # the block holding the last token is recomputed


def test_only_blocks_whose_kv_is_computed_are_shared() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    a = seq(list(range(1, 14)), "a")
    bm.allocate(a)
    bm.commit(a, 6)                   # a chunk of 6 tokens: only block 0 is whole
    b = seq(list(range(1, 14)), "b")
    bm.allocate(b)
    assert b.num_cached_tokens == 4 and b.block_table[0] == a.block_table[0]
    assert b.block_table[1] != a.block_table[1]
    bm.commit(a, 12)
    c = seq(list(range(1, 14)), "c")
    bm.allocate(c)
    assert c.num_cached_tokens == 12 and c.block_table[:3] == a.block_table[:3]


def test_blocks_filled_by_a_transfer_are_never_cached() -> None:
    bm = BlockManager(num_blocks=6, block_size=4)
    pulled = seq(list(range(1, 10)), "pulled")
    bm.allocate_fresh(pulled)
    pulled.token_ids.extend([5, 6, 7])
    bm.may_append(pulled)
    bm.commit(pulled, len(pulled))
    assert not bm.hash_to_block_id


def test_may_append_takes_a_block_at_the_boundary_and_registers_full_ones() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    a = seq([1, 2, 3], "a", block_size=2)
    bm.allocate(a)
    a.token_ids.append(4)           # block 1 becomes full with this token
    assert bm.can_append(a)
    bm.may_append(a)
    bm.commit(a, len(a))
    assert len(a.block_table) == 2 and bm.blocks[a.block_table[1]].hash is not None
    a.token_ids.append(5)
    bm.may_append(a)
    assert len(a.block_table) == 3 and bm.num_free_blocks == 0
    a.token_ids.append(6)
    bm.may_append(a)
    a.token_ids.append(7)
    assert not bm.can_append(a)


ops = st.lists(st.tuples(st.sampled_from(["add", "grow", "free"]), st.integers(0, 7),
                         st.lists(st.integers(0, 3), min_size=1, max_size=12)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops=ops, caching=st.booleans())
def test_blocks_are_never_double_allocated(ops: list, caching: bool) -> None:
    bm = BlockManager(num_blocks=12, block_size=3, enable_prefix_caching=caching)
    live: dict[int, Sequence] = {}
    for op, key, tokens in ops:
        if op == "add" and key not in live:
            s = seq(tokens, str(key), block_size=3)
            if bm.can_allocate(s):
                bm.allocate(s)
                bm.commit(s, len(s))
                live[key] = s
        elif op == "grow" and key in live:
            s = live[key]
            s.token_ids.append(tokens[0])
            if bm.can_append(s):
                bm.may_append(s)
                bm.commit(s, len(s))
            else:
                s.token_ids.pop()
        elif op == "free" and key in live:
            bm.free(live.pop(key))
        check_invariants(bm, list(live.values()))
        for s in live.values():
            assert len(s.block_table) == s.num_blocks
    for s in live.values():
        bm.free(s)
    assert bm.num_free_blocks == 12 and not bm.used_block_ids
