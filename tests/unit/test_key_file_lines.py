"""The keys file's lines (tandem.key_file): a line holds a salted hash that matches its key and no
other, never the key; a line for a key under the minimum strength, a malformed line and an id
listed twice are each left out with their line number while the other lines are taken."""

from __future__ import annotations

from tandem.api_keys import ApiKey, Tier
from tandem.key_file import MIN_KEY_BYTES, entry_for, generate_key, key_id_of, num_key_bytes_of, parse_key_file

ALICE = ApiKey(user_id="alice", tier=Tier.PLUS)


def test_a_generated_key_carries_the_minimum_and_its_line_matches_it_alone():
    key = generate_key()
    assert num_key_bytes_of(key) >= MIN_KEY_BYTES
    entry = entry_for(key, ALICE)
    assert key not in entry.line() and key.split(".", 1)[1] not in entry.line()
    entries, problems = parse_key_file(entry.line() + "\n")
    assert problems == []
    parsed = entries[key_id_of(key)]
    assert parsed.api_key == ALICE
    assert parsed.matches(key)
    assert not parsed.matches(key[:-1] + ("A" if key[-1] != "A" else "B"))
    assert not parsed.matches(generate_key())


def test_two_lines_for_one_key_have_different_salts_and_hashes():
    key = generate_key()
    first, second = entry_for(key, ALICE), entry_for(key, ALICE)
    assert first.salt != second.salt and first.digest != second.digest
    assert first.matches(key) and second.matches(key)


def test_bad_lines_are_left_out_by_number_and_the_others_taken():
    good, other = entry_for(generate_key(), ALICE), entry_for(generate_key(), ApiKey("bob", Tier.FREE))
    short = entry_for("tdm-short.0123456789abcdef", ALICE)  # 16 characters: 12 bytes
    text = "\n".join(
        ["# key_id salt hash tier user num_key_bytes", good.line(), short.line(), "just three fields", good.line(), other.line()]
    )
    entries, problems = parse_key_file(text)
    assert set(entries) == {good.key_id, other.key_id}
    reasons = [str(problem) for problem in problems]
    assert reasons[0].startswith("line 3: key 'tdm-short' carries 12 random bytes, under the minimum 32")
    assert reasons[1].startswith("line 4: must be `key_id salt hash tier user num_key_bytes`")
    assert reasons[2] == f"line 5: key id {good.key_id!r} is listed twice"
    assert len(reasons) == 3


def test_a_key_without_an_id_is_found_by_a_digest_of_the_whole_key():
    assert key_id_of("test-key").startswith("sha256-")
    assert key_id_of("test-key") != key_id_of("test-kez")
    assert key_id_of("tdm-abc.secret") == "tdm-abc"
    assert key_id_of("bad id.secret").startswith("sha256-")
