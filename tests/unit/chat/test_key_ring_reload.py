"""The chat's key ring (services.chat.key_ring) on a real file and a clock of the test's: the file
is looked at no more than once a check interval; a change counts at the next look; a bad line
written beside a revocation is left out and the revocation still counts; a file that goes away
refuses its keys; TANDEM_API_KEYS's keys are kept as hashes."""

from __future__ import annotations

import os

from services.chat.key_ring import KeyRing
from tandem.api_keys import ApiKey, Tier
from tandem.key_file import entry_for, generate_key

ALICE, BOB = ApiKey("alice", Tier.PLUS), ApiKey("bob", Tier.FREE)


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def write(path, *lines: str) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_text("".join(f"{line}\n" for line in lines))
    os.replace(temporary, path)  # as `tandem keys` does: a new file, never half of one


async def test_a_change_counts_at_the_next_look_and_not_before(tmp_path):
    path, clock = tmp_path / "keys", Clock()
    alice_key, bob_key = generate_key(), generate_key()
    write(path, entry_for(alice_key, ALICE).line())
    ring = KeyRing({}, path, check_every_s=1.0, clock=clock)
    ring.refresh()
    clock.now_s = 1.0
    assert await ring.caller_of(alice_key) == ALICE
    write(path, entry_for(bob_key, BOB).line())
    clock.now_s = 1.5  # before the next look: the old file still holds
    assert await ring.caller_of(alice_key) == ALICE
    clock.now_s = 2.0
    assert await ring.caller_of(alice_key) is None
    assert await ring.caller_of(bob_key) == BOB


async def test_a_revocation_counts_beside_a_bad_line_and_a_missing_file_refuses_all(tmp_path):
    path, clock = tmp_path / "keys", Clock()
    alice_key, bob_key = generate_key(), generate_key()
    write(path, entry_for(alice_key, ALICE).line(), entry_for(bob_key, BOB).line())
    ring = KeyRing({}, path, check_every_s=1.0, clock=clock)
    clock.now_s = 1.0
    assert await ring.caller_of(alice_key) == ALICE
    write(path, entry_for(bob_key, BOB).line(), "not a line")
    clock.now_s = 2.0
    assert await ring.caller_of(alice_key) is None
    assert await ring.caller_of(bob_key) == BOB
    path.unlink()
    clock.now_s = 3.0
    assert await ring.caller_of(bob_key) is None
    assert ring.known_caller(bob_key) is None


async def test_environment_keys_are_held_as_hashes_and_a_checked_key_is_remembered():
    ring = KeyRing.load({"test-key": ALICE}, None)
    assert "test-key" not in repr(vars(ring))
    assert ring.known_caller("test-key") is None  # not checked yet
    assert await ring.caller_of("test-key") == ALICE
    assert ring.known_caller("test-key") == ALICE
    assert await ring.caller_of("test-kez") is None
