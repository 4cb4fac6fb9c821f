"""Fixed, logged seeds for tests that want fresh random inputs without the global RNG's hidden state.

``fixed_seed()`` derives the seed from the running test's id and how many seeds that test has drawn, so a
failing test re-runs with the same numbers, and it prints the seed (pytest shows it with the failure).
"""

from __future__ import annotations

import os
import zlib

_draws: dict[str, int] = {}


def fixed_seed() -> int:
    test = os.environ.get("PYTEST_CURRENT_TEST", "outside-pytest").rsplit(" ", 1)[0]
    n = _draws.get(test, 0)
    _draws[test] = n + 1
    seed = (zlib.crc32(test.encode()) + n) % 2**31
    print(f"seed {seed} ({test}, draw {n})")
    return seed
