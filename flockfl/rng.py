"""Stateless random streams keyed by (seed, round, client, purpose).

Every random draw in flockfl comes from a generator built here, never from global RNG
state. Because a stream is a pure function of its key, a resumed run draws exactly what an
uninterrupted run would have drawn, and changing one purpose never shifts another.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

GLOBAL = -1  # use for "no round" / "no client"


def _purpose_code(purpose: str) -> int:
    return zlib.crc32(purpose.encode("utf-8"))


def seed_sequence(seed: int, round: int = GLOBAL, client: int = GLOBAL, purpose: str = "") -> np.random.SeedSequence:
    # SeedSequence entropy must be non-negative: shift the -1 sentinels to 0.
    return np.random.SeedSequence([int(seed) & 0xFFFFFFFF, int(round) + 1, int(client) + 1, _purpose_code(purpose)])


def np_rng(seed: int, round: int = GLOBAL, client: int = GLOBAL, purpose: str = "") -> np.random.Generator:
    """A NumPy generator for one (seed, round, client, purpose) key."""
    return np.random.Generator(np.random.PCG64(seed_sequence(seed, round, client, purpose)))


def torch_generator(seed: int, round: int = GLOBAL, client: int = GLOBAL, purpose: str = "") -> torch.Generator:
    """A CPU torch generator for one key (used for parameter initialisation)."""
    g = torch.Generator()
    g.manual_seed(int(seed_sequence(seed, round, client, purpose).generate_state(1, np.uint64)[0] >> 1))
    return g
