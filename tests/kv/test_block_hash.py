from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ferrum.kv.block_hash import NONE_HASH, extend_block_hashes, hash_block_tokens


def test_hashes_chain_over_full_blocks_only() -> None:
    tokens = list(range(10))
    hashes: list[int] = []
    assert extend_block_hashes(hashes, tokens, 4) == 2
    h0 = hash_block_tokens(NONE_HASH, [0, 1, 2, 3])
    h1 = hash_block_tokens(h0, [4, 5, 6, 7])
    assert hashes == [h0, h1]


def test_extending_step_by_step_matches_one_shot() -> None:
    tokens = [7, 3, 9, 1, 4, 4, 2, 8, 5, 6, 0, 1, 3]
    one_shot: list[int] = []
    extend_block_hashes(one_shot, tokens, 3)
    grown: list[int] = []
    added = [extend_block_hashes(grown, tokens[:n], 3) for n in range(len(tokens) + 1)]
    assert grown == one_shot
    assert len(grown) == len(tokens) // 3
    assert sum(added) == 4
    assert added[3] == 1 and added[4] == 0


def test_hash_depends_on_parent_tokens_and_extra_keys() -> None:
    base = hash_block_tokens(NONE_HASH, [1, 2])
    assert base == hash_block_tokens(NONE_HASH, (1, 2))
    assert base != hash_block_tokens(base, [1, 2])
    assert base != hash_block_tokens(NONE_HASH, [2, 1])
    assert base != hash_block_tokens(NONE_HASH, [1, 2], extra_keys=("adapter-1",))
    with_key = hash_block_tokens(NONE_HASH, [1, 2], extra_keys=("adapter-1",))
    assert with_key == hash_block_tokens(NONE_HASH, [1, 2], extra_keys=("adapter-1",))


def test_extra_keys_apply_to_every_block() -> None:
    plain: list[int] = []
    keyed: list[int] = []
    extend_block_hashes(plain, [1, 2, 3, 4], 2)
    extend_block_hashes(keyed, [1, 2, 3, 4], 2, extra_keys=(5,))
    assert keyed[0] == hash_block_tokens(NONE_HASH, [1, 2], (5,))
    assert keyed[1] == hash_block_tokens(keyed[0], [3, 4], (5,))
    assert set(plain).isdisjoint(keyed)


def test_hash_is_stable_across_processes() -> None:
    code = (
        "from ferrum.kv.block_hash import extend_block_hashes as e; h = []; "
        "e(h, list(range(12)), 4); print(h)"
    )
    outputs = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        result = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        outputs.add(result.stdout)
    expected: list[int] = []
    extend_block_hashes(expected, list(range(12)), 4)
    assert outputs == {f"{expected}\n"}


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="block_size"):
        extend_block_hashes([], [1, 2], 0)
    hashes = [123, 456]
    with pytest.raises(ValueError, match="block_hashes has 2 entries"):
        extend_block_hashes(hashes, [1, 2, 3], 2)
