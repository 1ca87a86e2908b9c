"""Which engine replica runs a request: prefix-cache-aware, round-robin, or least-loaded.

Plain Python over plain data (replica indices, token ids, in-flight counts), so that the
policies can be read, and tested, without Ray. The Ray ingress (``mie.serve.cluster``) asks
its router for an *order of preference* over the live replicas and tries them in that order:
the first one normally takes the request; the next ones are where it goes when a replica
refuses it (its ``--max-queue`` is full) or has just died.

``prefix`` (the default): a replica's prefix cache only helps requests that land on it, so
requests whose prompts begin with the same full KV blocks should land on the same replica.
The key is the token ids of the prompt's first ``prefix_blocks`` full blocks; it is placed on
a consistent-hash ring over the live replicas, so a replica that dies (or comes back) moves
only the keys it owned. Pure affinity would pile a popular prefix onto one replica while the
others idle, so, as in SGLang's cache-aware router, the choice falls back to the least-loaded
replica when the chosen one is *much busier*: more than ``abs_threshold`` requests in flight
beyond the least-loaded one **and** more than ``rel_threshold`` times its load. A prompt
shorter than one block has nothing a cache could share: it goes to the least-loaded replica.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
from array import array
from collections.abc import Mapping, Sequence

ROUTERS = ("prefix", "round-robin", "least-loaded")

PREFIX_BLOCKS = 1  # blocks of the prompt that make up its routing key
VIRTUAL_NODES = 64  # points per replica on the ring: keys spread evenly over replicas
# Fall back to the least-loaded replica when the chosen one has more than ABS_THRESHOLD more
# requests in flight *and* more than REL_THRESHOLD times as many (0 in flight counts as 1).
ABS_THRESHOLD = 8
REL_THRESHOLD = 2.0


class Router:
    """A routing policy: ``order`` ranks the live replicas for one request."""

    name = ""

    def order(
        self, token_ids: Sequence[int], live: Sequence[int], load: Mapping[int, int]
    ) -> list[int]:
        """Every live replica once, the one to try first first. ``load``: requests in flight
        per replica (as the ingress counts them); a replica missing from it has none."""
        raise NotImplementedError


def by_load(live: Sequence[int], load: Mapping[int, int]) -> list[int]:
    """Live replicas from least to most loaded (ties: lower index first)."""
    return sorted(live, key=lambda r: (load.get(r, 0), r))


class LeastLoadedRouter(Router):
    """The replica with the fewest requests in flight: even load, no cache affinity."""

    name = "least-loaded"

    def order(self, token_ids, live, load):
        return by_load(live, load)


class RoundRobinRouter(Router):
    """Each live replica in turn, whatever the prompt or the load: the baseline."""

    name = "round-robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def order(self, token_ids, live, load):
        ranked = sorted(live)
        if not ranked:
            return []
        start = next(self._turn) % len(ranked)
        return ranked[start:] + ranked[:start]


class HashRing:
    """A consistent-hash ring: ``VIRTUAL_NODES`` points per replica; a key belongs to the
    first point at or after its hash (wrapping round) whose replica is live."""

    def __init__(self, replicas: Sequence[int], virtual_nodes: int = VIRTUAL_NODES) -> None:
        points = sorted(
            (_hash(f"replica-{r}-{v}".encode()), r) for r in replicas for v in range(virtual_nodes)
        )
        self._hashes = [h for h, _ in points]
        self._owners = [r for _, r in points]

    def owner(self, key: bytes, live: Sequence[int]) -> int | None:
        """The live replica that owns ``key``; None when no replica is live."""
        alive = set(live)
        if not self._hashes or not alive:
            return None
        start = bisect.bisect_left(self._hashes, _hash(key))
        n = len(self._hashes)
        for i in range(n):
            owner = self._owners[(start + i) % n]
            if owner in alive:
                return owner
        return None


class PrefixRouter(Router):
    """Cache-aware: same leading blocks, same replica, unless it is much busier (module doc)."""

    name = "prefix"

    def __init__(
        self,
        replicas: Sequence[int],
        block_size: int,
        *,
        prefix_blocks: int = PREFIX_BLOCKS,
        abs_threshold: int = ABS_THRESHOLD,
        rel_threshold: float = REL_THRESHOLD,
    ) -> None:
        if block_size < 1 or prefix_blocks < 1:
            raise ValueError(
                f"block_size and prefix_blocks must be >= 1, got {block_size}, {prefix_blocks}"
            )
        self.block_size = block_size
        self.prefix_blocks = prefix_blocks
        self.abs_threshold = abs_threshold
        self.rel_threshold = rel_threshold
        self.ring = HashRing(replicas)
        self.fallbacks = 0  # requests sent past their owner because it was much busier

    def key(self, token_ids: Sequence[int]) -> bytes | None:
        """The routing key: the ids of the prompt's first full blocks (at most
        ``prefix_blocks``), as bytes; None for a prompt shorter than one block."""
        full = min(len(token_ids) // self.block_size, self.prefix_blocks)
        if full == 0:
            return None
        return array("q", token_ids[: full * self.block_size]).tobytes()

    def much_busier(self, chosen: int, least: int) -> bool:
        """Whether a replica with ``chosen`` requests in flight is much busier than one with
        ``least``: the fallback rule of the module doc."""
        return chosen - least > self.abs_threshold and chosen > self.rel_threshold * max(least, 1)

    def order(self, token_ids, live, load):
        ranked = by_load(live, load)
        key = self.key(token_ids)
        owner = None if key is None else self.ring.owner(key, live)
        if owner is None:
            return ranked
        if self.much_busier(load.get(owner, 0), load.get(ranked[0], 0)):
            self.fallbacks += 1
            return ranked
        return [owner, *(r for r in ranked if r != owner)]


def make_router(name: str, replicas: Sequence[int], block_size: int) -> Router:
    """The router called ``name`` (one of ``ROUTERS``) over ``replicas``."""
    if name == "prefix":
        return PrefixRouter(replicas, block_size)
    if name == "round-robin":
        return RoundRobinRouter()
    if name == "least-loaded":
        return LeastLoadedRouter()
    raise ValueError(f"unknown router {name!r}; choose one of {', '.join(ROUTERS)}")


def _hash(data: bytes) -> int:
    """A hash that is the same in every process (Python's ``hash`` of bytes is salted)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")
