"""Which replica takes an LLM generation: prefix affinity with bounded load (pure policy).

The LLM engines keep a prefix cache (``model_repository/adapters/_llm_core.py``: blocks of
``prefix_block`` prompt tokens under chained hashes; vLLM's automatic prefix caching likewise): a
prompt whose first blocks an engine computed before skips that prefill. The cache is per replica,
so round robin over N replicas computes a shared system prompt N times and hits it 1/N as often.
This module picks the replica; ``server.dataplane.replicas.ReplicaSet`` feeds it what it knows
of each member.

**The key** (:func:`prefix_key`) is computed in the frontend, which has the messages or the
prompt text but not the tokens: a hash of the first ``chars`` characters (512 by default, roughly
100-150 tokens, 6-9 blocks of 16) of the request's text in order (each message's role and
content). Requests that share a system prompt at least that long share the key whatever the user
asked; a shorter shared start (a one-line system prompt) is not worth affinity — a few blocks of
prefill — so those requests spread by their own first words. Characters, not tokens: the chat
template adds the same tokens before the same text, so equal leading text is an equal leading
token run except at the cut, which only costs the last block.

**The choice** (:func:`choose`), among the members serving the model:

* ``round_robin`` — the next member in turn (the baseline the benchmark compares with);
* ``least_outstanding`` — the replica set's own choice for every other request (power of two
  choices over requests in flight, an idle member first); this module leaves it to the set;
* ``prefix_aware`` — *rendezvous hashing with bounded load*: the members are ranked by
  ``hash(key, member)`` (every frontend process ranks them alike, and a member joining or leaving
  moves only the keys it wins or held), and the first one in that order that is *within bounds*
  takes the request. Within bounds: its outstanding streams plus this one are at most
  ``load_factor`` x the mean over the members (this request included) plus ``load_slack``, and its
  KV-cache utilisation, when known and fresh, is below ``kv_high``. A hot prefix therefore fills
  its own replica up to the bound and spills to the *second* member of its ranking (which then
  caches it too), not to a random one. When no member is within bounds, the least loaded one
  (outstanding, then KV utilisation, then rank) takes it.

Outstanding streams are the frontend's own count (queue depth as this process sees it, which
includes the engine's waiting queue); KV utilisation comes from the engines (the fraction of the KV
budget their scheduler holds, reported with each finished generation) and is ``None`` when
unknown or stale, in which case only the load bound applies.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

ROUND_ROBIN, LEAST_OUTSTANDING, PREFIX_AWARE = "round_robin", "least_outstanding", "prefix_aware"
POLICIES = (ROUND_ROBIN, LEAST_OUTSTANDING, PREFIX_AWARE)
AFFINITY, SPILL, FALLBACK, TURN = "affinity", "spill", "fallback", "turn"  # why a member was chosen


@dataclass(frozen=True)
class RouteBounds:
    load_factor: float = 1.25  # a member may hold this many times the mean outstanding (this request included) ...
    load_slack: float = 1.0  # ... plus this many streams, before it loses its keys' affinity
    kv_high: float = 0.9  # a member whose KV cache is fuller than this loses affinity too


@dataclass(frozen=True)
class Load:
    """What the chooser knows of one member: streams in flight there, KV use (0..1; None unknown)."""

    member: str
    outstanding: int = 0
    kv: float | None = None


def prefix_key(messages: Sequence[dict[str, Any]] | None = None, prompt: str | None = None, chars: int = 512) -> str:
    """A short hex key of the request's leading ``chars`` characters of text ("" with no text)."""
    if chars <= 0:
        return ""
    if messages is not None:
        parts, left = [], chars
        for message in messages:
            content = message.get("content", "") if isinstance(message, dict) else ""
            if not isinstance(content, str):  # content parts (a list): their text, in order
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict)) if isinstance(content, list) else ""
            piece = f"{message.get('role', '') if isinstance(message, dict) else ''}\x1f{content}\x1e"
            parts.append(piece[:left])
            left -= len(piece)
            if left <= 0:
                break
        text = "".join(parts)
    else:
        text = (prompt or "")[:chars]
    if not text:
        return ""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


def rank(key: str, members: Sequence[str]) -> list[int]:
    """Indexes of ``members`` in rendezvous order for ``key`` (highest hash first)."""
    weights = [int.from_bytes(hashlib.blake2b(f"{key}\x00{m}".encode(), digest_size=8).digest(), "big") for m in members]
    return sorted(range(len(members)), key=lambda i: (-weights[i], members[i]))


def within_bounds(load: Load, total: int, n: int, bounds: RouteBounds) -> bool:
    """``total``: outstanding over the ``n`` candidates before this request."""
    if load.outstanding + 1 > cap(total, n, bounds) + 1e-9:
        return False
    return load.kv is None or load.kv < bounds.kv_high


def choose_prefix_aware(key: str, loads: Sequence[Load], bounds: RouteBounds = RouteBounds()) -> tuple[int, str]:
    """(index into ``loads``, why): ``affinity`` (the key's first member), ``spill`` (a later
    member of its ranking) or ``fallback`` (nobody within bounds: the least loaded)."""
    if not loads:
        raise ValueError("no member to choose from")
    order = rank(key, [load.member for load in loads])
    total = sum(load.outstanding for load in loads)
    for position, i in enumerate(order):
        if within_bounds(loads[i], total, len(loads), bounds):
            return i, AFFINITY if position == 0 else SPILL
    position = {i: p for p, i in enumerate(order)}
    best = min(range(len(loads)), key=lambda i: (loads[i].outstanding, loads[i].kv if loads[i].kv is not None else 0.0, position[i]))
    return best, FALLBACK


def choose_round_robin(turn: int, loads: Sequence[Load]) -> tuple[int, str]:
    """(index, ``turn``): the ``turn``-th member in member-name order, cyclically."""
    if not loads:
        raise ValueError("no member to choose from")
    order = sorted(range(len(loads)), key=lambda i: loads[i].member)
    return order[turn % len(loads)], TURN


def parse_policy(name: str) -> str:
    name = (name or "").strip().lower().replace("-", "_")
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r} (one of {', '.join(POLICIES)})")
    return name


def cap(total: int, n: int, bounds: RouteBounds) -> float:
    """The most streams a member may hold and keep affinity (for explanations and tests)."""
    return max(1.0, bounds.load_factor * (total + 1) / n + bounds.load_slack)

