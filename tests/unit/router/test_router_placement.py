import itertools

from router_fakes import MODEL, decode_worker, request

from services.router.placement import Placement, PlacementConfig, affinity_key, rendezvous_weight


def ranked_ids(workers, key="conv-1", model=MODEL, placement=None, req=None):
    placement = placement or Placement()
    return [w.instance_id for w in placement.rank(workers, model, req or request(), key)]


def test_the_least_loaded_worker_wins_whatever_the_conversation():
    workers = [decode_worker("d1", num_running=3), decode_worker("d2", num_running=1), decode_worker("d3", num_waiting=2)]
    for key in (f"conv-{i}" for i in range(20)):
        assert ranked_ids(workers, key) == ["d2", "d3", "d1"]


def test_running_waiting_and_queued_prefill_all_count_as_load():
    placement = Placement(PlacementConfig(prefill_tokens_per_unit=100))
    busy_prefill = decode_worker("d1", queued_prefill_tokens=250)  # 2.5 units
    busy_decode = decode_worker("d2", num_running=1, num_waiting=1)  # 2 units
    assert placement.load(busy_prefill) == 2.5
    assert placement.load(busy_decode) == 2.0
    assert ranked_ids([busy_prefill, busy_decode], placement=placement) == ["d2", "d1"]


def test_replies_this_router_sent_since_the_last_heartbeat_count_as_load():
    assert ranked_ids([decode_worker("d1", num_assigned=2), decode_worker("d2", num_running=1)]) == ["d2", "d1"]


def test_equal_load_keeps_a_conversation_on_one_worker_whatever_the_listing_order():
    workers = [decode_worker(f"d{i}", num_running=1) for i in range(4)]
    first = ranked_ids(workers, "conv-42")
    for ordering in itertools.permutations(workers):
        assert ranked_ids(list(ordering), "conv-42") == first
    assert ranked_ids(workers, "conv-42") == first  # and on every call


def test_equal_load_spreads_different_conversations_over_the_workers():
    workers = [decode_worker(f"d{i}") for i in range(4)]
    counts = {w.instance_id: 0 for w in workers}
    for i in range(400):
        counts[ranked_ids(workers, f"conv-{i}")[0]] += 1
    # 100 expected each; rendezvous hashing is uniform, so none strays far.
    assert all(60 <= n <= 140 for n in counts.values()), counts


def test_a_lost_worker_moves_only_its_own_conversations():
    workers = [decode_worker(f"d{i}") for i in range(4)]
    before = {f"conv-{i}": ranked_ids(workers, f"conv-{i}")[0] for i in range(200)}
    after = {key: ranked_ids(workers[1:], key)[0] for key in before}
    moved = [key for key in before if before[key] != after[key]]
    assert moved and all(before[key] == "d0" for key in moved)


def test_workers_that_cannot_take_the_reply_are_left_out():
    workers = [
        decode_worker("not-ready", is_ready=False),
        decode_worker("loading", is_engine_ready=False),
        decode_worker("no-window", max_model_len=0),
        decode_worker("other-model", model="Llama-3-8B"),
        decode_worker("good", num_running=50),
    ]
    assert ranked_ids(workers) == ["good"]
    assert ranked_ids(workers, model="Llama-3-8B") == ["other-model"]


def test_tie_slack_lets_affinity_beat_a_slightly_lower_load():
    workers = [decode_worker("d1"), decode_worker("d2")]
    key = next(f"conv-{i}" for i in range(100) if ranked_ids(workers, f"conv-{i}")[0] == "d2")
    nudged = [decode_worker("d1"), decode_worker("d2", num_running=1)]
    assert ranked_ids(nudged, key) == ["d1", "d2"]
    sticky = Placement(PlacementConfig(tie_slack=1.0))
    assert ranked_ids(nudged, key, placement=sticky) == ["d2", "d1"]
    assert ranked_ids([decode_worker("d1"), decode_worker("d2", num_running=2)], key, placement=sticky) == ["d1", "d2"]


def test_the_cached_tokens_hook_lowers_a_workers_cost():
    workers = [decode_worker("d1", num_running=1), decode_worker("d2")]
    req = request(num_prompt_tokens=2048)
    assert ranked_ids(workers, req=req) == ["d2", "d1"]
    warm_d1 = Placement(cached_tokens=lambda worker, req: 2048 if worker.instance_id == "d1" else 0)
    assert ranked_ids(workers, req=req, placement=warm_d1) == ["d1", "d2"]


def test_the_affinity_key_is_the_conversation_else_the_reply():
    assert affinity_key(request(conversation_id="c-1"), "r-1") == "c-1"
    assert affinity_key(request(), "r-1") == "r-1"


def test_rendezvous_weights_are_stable_across_processes():
    # Fixed values: Python's salted hash() would change them on every run.
    # Every router, on every host and after every restart, must rank a conversation alike.
    assert rendezvous_weight("conv-1", "d1") == 12503072550463796229
    assert rendezvous_weight("conv-1", "d1") != rendezvous_weight("conv-1", "d2")
    assert rendezvous_weight("a", "bc") != rendezvous_weight("ab", "c")
