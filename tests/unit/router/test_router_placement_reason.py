"""Why a placement chose its worker, as the placement metric names it."""

from router_fakes import MODEL, decode_worker, request

from services.router.placement import Placement


def reason_for(workers, placement=None, cached=None) -> str:
    placement = placement or Placement(cached_tokens=lambda w, r: (cached or {}).get(w.instance_id, 0))
    req = request()
    ranked = placement.rank(workers, MODEL, req, "conv-1")
    return placement.reason(ranked, req)


def test_each_reason_is_named_by_what_decided_the_placement():
    assert reason_for([decode_worker("d1")]) == "only_worker"
    assert reason_for([decode_worker("d1", num_running=2), decode_worker("d2")]) == "load"
    assert reason_for([decode_worker("d1"), decode_worker("d2")]) == "rendezvous"
    assert reason_for([decode_worker("d1"), decode_worker("d2")], cached={"d1": 16, "d2": 16}) == "cache_hit"


def test_a_worker_moved_ahead_of_cheaper_ones_for_the_lane_says_so():
    placement = Placement()
    req = request()
    cheap, dear = decode_worker("d1"), decode_worker("d2", num_running=3)
    assert placement.reason([dear, cheap], req) == "lane"
