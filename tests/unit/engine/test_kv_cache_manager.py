from tandem.engine.block_pool import KvEventKind
from tandem.engine.kv_cache_manager import KvCacheManager
from tandem.engine.sequence import Lane, Sequence


def manager(num_blocks: int = 32) -> KvCacheManager:
    return KvCacheManager(num_blocks, block_size=16)


def compute(kv: KvCacheManager, seq: Sequence, num_tokens: int) -> None:
    """What a step does for one chunk: room, KV written, full blocks cached."""
    assert kv.allocate_slots(seq, num_tokens)
    seq.advance_computed(num_tokens)
    kv.cache_full_blocks(seq)


def prefilled(kv: KvCacheManager, prompt: list[int], tenant: str = "a", num_public_prefix_tokens: int = 0) -> Sequence:
    seq = Sequence(f"seq-{tenant}-{len(prompt)}", prompt, tenant=tenant, num_public_prefix_tokens=num_public_prefix_tokens)
    kv.find_cached_prefix(seq)
    compute(kv, seq, seq.num_uncomputed_tokens)
    return seq


def test_a_tenants_cached_blocks_are_no_hit_for_another_tenant():
    kv = manager()
    prompt = list(range(50))
    first = prefilled(kv, prompt, tenant="a")
    first_blocks = first.block_table[:3]
    kv.free(first)
    other_tenant = Sequence("b", prompt, tenant="b")
    same_tenant = Sequence("a2", prompt, tenant="a")
    assert kv.find_cached_prefix(other_tenant) == 0
    assert kv.find_cached_prefix(same_tenant) == 48
    assert same_tenant.block_table == first_blocks


def test_public_prefix_blocks_are_hits_for_every_tenant_and_the_rest_is_not():
    kv = manager()
    prompt = list(range(60))
    prefilled(kv, prompt, tenant="a", num_public_prefix_tokens=32)
    other = Sequence("b", prompt, tenant="b", num_public_prefix_tokens=32)
    assert kv.find_cached_prefix(other) == 32
    assert (other.num_computed_tokens, len(other.block_table), len(other.block_hashes)) == (32, 2, 2)


def test_a_fully_cached_prompt_still_leaves_tokens_to_compute():
    kv = manager()
    prompt = list(range(32))
    prefilled(kv, prompt)
    again = Sequence("again", prompt, tenant="a")
    assert kv.find_cached_prefix(again) == 16  # the last block is recomputed for its logits
    assert again.num_uncomputed_tokens == 16
    longer = Sequence("longer", prompt + [7], tenant="a")
    assert kv.find_cached_prefix(longer) == 32
    assert longer.num_uncomputed_tokens == 1


def test_allocate_slots_grows_the_block_table_to_cover_the_new_tokens_exactly():
    kv = manager(num_blocks=4)
    seq = Sequence("s", list(range(40)))
    assert kv.allocate_slots(seq, 17) and len(seq.block_table) == 2
    seq.advance_computed(17)
    assert kv.allocate_slots(seq, 15) and len(seq.block_table) == 2  # 32 tokens still fit in 2 blocks
    assert kv.allocate_slots(seq, 16) and len(seq.block_table) == 3
    assert not kv.allocate_slots(seq, 48)  # would need 5 blocks of 4
    assert len(seq.block_table) == 3  # a refusal takes nothing


def test_max_new_tokens_keeps_the_reserve_free():
    kv = manager(num_blocks=4)
    seq = Sequence("s", list(range(64)))
    assert kv.max_new_tokens(seq, num_reserved_blocks=1) == 48  # 48 fit, 49 do not
    assert kv.max_new_tokens(seq, num_reserved_blocks=0) == 64
    assert kv.blocks_needed(49) == 4


def test_output_blocks_are_cached_too():
    kv = manager()
    seq = Sequence("s", list(range(20)), tenant="a")
    compute(kv, seq, 20)
    for token in range(500, 513):  # 13 decoded tokens: 33 in all, 32 computed after the last step
        seq.append_token(token)
        compute(kv, seq, 1)
    assert len(seq.block_hashes) == 2
    follow_up = Sequence("turn-2", seq.token_ids + [9, 9], tenant="a")
    assert kv.find_cached_prefix(follow_up) == 32


def test_free_releases_the_tail_first_so_the_prefix_is_reused_last():
    kv = manager(num_blocks=3)
    seq = Sequence("s", list(range(48)))
    compute(kv, seq, 48)
    blocks = list(seq.block_table)
    kv.free(seq)
    assert (seq.block_table, seq.block_hashes, seq.num_computed_tokens) == ([], [], 0)
    other = Sequence("other", list(range(100, 116)))
    assert kv.allocate_slots(other, 16) and other.block_table == [blocks[2]]


def test_caching_a_prefill_announces_each_block_with_its_parent():
    kv = manager()
    seq = prefilled(kv, list(range(50)))
    events = kv.drain_events()
    assert [(e.kind, e.block_hash, e.parent_hash) for e in events] == [
        (KvEventKind.STORED, key, parent) for key, parent in zip(seq.block_hashes, [None, *seq.block_hashes[:-1]])
    ]
    assert len(events) == 3


def test_a_paid_sequences_cached_prefix_outlives_free_work_under_pressure():
    kv = manager(num_blocks=4)
    paid = Sequence("paid", list(range(32)), tenant="p", lane=Lane.PAID)
    compute(kv, paid, 32)
    kv.free(paid)  # two cached blocks, kept
    for turn in range(3):  # free work, over and over, in the two other blocks
        free = Sequence(f"free-{turn}", list(range(1000 + 100 * turn, 1032 + 100 * turn)), tenant="f", lane=Lane.FREE)
        kv.find_cached_prefix(free)
        compute(kv, free, free.num_uncomputed_tokens)
        kv.free(free)
    again = Sequence("paid-again", [*range(32), 7], tenant="p", lane=Lane.PAID)
    assert kv.find_cached_prefix(again) == 32  # both of its blocks were still cached


def test_only_a_paid_sequences_prompt_blocks_are_kept_its_answers_go_first():
    kv = manager(num_blocks=8)
    paid = [Sequence(f"paid-{n}", list(range(100 * n, 100 * n + 32)), tenant="p", lane=Lane.PAID) for n in range(2)]
    for seq in paid:
        compute(kv, seq, 32)
        for token in range(17):  # its answer: 16 tokens fill a block, the 17th starts one
            seq.append_token(token)
            compute(kv, seq, 1)
    answers = [block for seq in paid for block in seq.block_table[2:]]
    for seq in paid:
        kv.free(seq)  # the first one's prompt was freed before the second one's answer
    free = Sequence("free", list(range(1000, 1064)), tenant="f", lane=Lane.FREE)
    compute(kv, free, 64)  # four blocks: both answers', none of the prompts'
    assert sorted(free.block_table) == sorted(answers)
    for n in range(2):
        again = Sequence(f"paid-again-{n}", [*range(100 * n, 100 * n + 32), 7], tenant="p", lane=Lane.PAID)
        assert kv.find_cached_prefix(again) == 32
