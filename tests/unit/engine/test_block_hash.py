import os
import subprocess
import sys

from tandem.engine.block_hash import PUBLIC_NAMESPACE, block_hash, prefix_block_hashes

TOKENS = list(range(100, 116))


def test_the_hash_is_the_same_in_another_process_with_another_hash_seed():
    here = [block_hash(None, TOKENS, "tenant-a"), block_hash(12345, TOKENS, PUBLIC_NAMESPACE)]
    code = (
        "from tandem.engine.block_hash import block_hash; "
        f"print(block_hash(None, {TOKENS}, 'tenant-a'), block_hash(12345, {TOKENS}, 'public'))"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert [int(x) for x in out.split()] == here


def test_the_hash_of_a_known_block_never_changes():
    # Routers and workers of different releases must agree; a new byte layout breaks that.
    assert block_hash(None, TOKENS, "tenant-a") == 5284624013800871306


def test_the_hash_is_an_unsigned_64_bit_int():
    key = block_hash(None, TOKENS, "t")
    assert isinstance(key, int) and 0 <= key < 2**64


def test_tokens_parent_and_namespace_all_change_the_hash():
    base = block_hash(1, TOKENS, "a")
    assert block_hash(2, TOKENS, "a") != base
    assert block_hash(None, TOKENS, "a") != base
    assert block_hash(1, TOKENS, "b") != base
    assert block_hash(1, TOKENS[:-1] + [0], "a") != base


def test_blocks_wholly_inside_the_public_prefix_are_shared_between_tenants():
    tokens = list(range(64))
    a = prefix_block_hashes(tokens, tenant="a", num_public_prefix_tokens=40, block_size=16)
    b = prefix_block_hashes(tokens, tenant="b", num_public_prefix_tokens=40, block_size=16)
    assert len(a) == 4
    assert a[:2] == b[:2]  # tokens 0..31 are public
    assert a[2] != b[2]  # tokens 32..47 straddle the end of the public prefix: the tenant's


def test_continuing_a_chain_gives_the_same_keys_as_hashing_at_once():
    tokens = list(range(64))
    whole = prefix_block_hashes(tokens, tenant="a", num_public_prefix_tokens=16, block_size=16)
    head = prefix_block_hashes(tokens[:32], tenant="a", num_public_prefix_tokens=16, block_size=16)
    tail = prefix_block_hashes(
        tokens[32:], tenant="a", num_public_prefix_tokens=16, block_size=16, parent_hash=head[-1], first_block_index=2
    )
    assert head + tail == whole
