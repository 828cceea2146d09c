"""Which live member should own a scope: rendezvous (highest-random-weight) hashing.

Each member scores each scope with a hash of the pair; the highest score owns it. So a member that joins takes
only the scopes it now scores highest on (about 1/N of them) and a member that leaves hands over only its own;
every other scope stays where it is. Nothing is stored: every replica computes the same answer from the same
member list. blake2b, not ``hash()``: the score must be equal in every process (``PYTHONHASHSEED``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence


def score(scope: str, member: str) -> int:
    digest = hashlib.blake2b(f"{len(member)}:{member}|{scope}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def preferred_owner(scope: str, members: Iterable[str]) -> str | None:
    """The member that should own ``scope``; None when there is no member. Ties (a 64-bit collision) go to the
    larger name, so the answer never depends on the order of ``members``."""
    best: tuple[int, str] | None = None
    for member in members:
        key = (score(scope, member), member)
        if best is None or key > best:
            best = key
    return None if best is None else best[1]


def share_of(member: str, scopes: Sequence[str], members: Sequence[str]) -> tuple[str, ...]:
    """The scopes ``member`` should own among ``scopes``, in their given order."""
    return tuple(scope for scope in scopes if preferred_owner(scope, members) == member)
