from tandem.bus.cancels import RecentCancels


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def test_a_cancel_is_remembered_for_a_while_then_forgotten():
    clock = Clock()
    cancels = RecentCancels(remember_s=10, clock=clock)
    cancels.note("a")
    clock.now_s = 9.9
    assert "a" in cancels and "b" not in cancels
    clock.now_s = 10.1
    assert "a" not in cancels


def test_old_entries_are_dropped_as_new_ones_come():
    clock = Clock()
    cancels = RecentCancels(remember_s=10, clock=clock)
    for i in range(100):
        clock.now_s = float(i)
        cancels.note(str(i))
    assert len(cancels._at_s) <= 11
