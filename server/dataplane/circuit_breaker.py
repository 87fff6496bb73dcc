"""A circuit breaker per Triton replica (pure: injectable clock, no I/O).

CLOSED: calls go through; ``failure_threshold`` consecutive failures open the circuit.
OPEN: calls are refused at once (``BackendUnavailable`` with a retry hint) for ``open_s``.
HALF_OPEN: after ``open_s``, up to ``half_open_probes`` calls go through as probes; that many
successes close the circuit, one failure opens it again (for ``open_s`` again).

Only failures that say the replica is sick count (unavailable, internal errors, deadline
exceeded on the Triton side); a caller's invalid request or a cancelled call does not.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from server.errors import BackendError, BackendUnavailable, DeadlineExceeded, InferplaneError

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


@dataclass(frozen=True)
class BreakerPolicy:
    failure_threshold: int = 5
    open_s: float = 2.0
    half_open_probes: int = 1


def counts_as_failure(err: BaseException) -> bool:
    """Does this error say the replica is unhealthy (not the request, not the caller)?"""
    if isinstance(err, InferplaneError):
        return isinstance(err, (BackendUnavailable, BackendError, DeadlineExceeded)) and type(err) is not InferplaneError
    return not isinstance(err, (KeyboardInterrupt, SystemExit, GeneratorExit)) and isinstance(err, Exception)


class CircuitBreaker:
    def __init__(self, name: str, policy: BreakerPolicy = BreakerPolicy(), clock: Callable[[], float] = time.monotonic):
        self.name = name
        self.policy = policy
        self._clock = clock
        self.state = CLOSED
        self.failures = 0  # consecutive
        self.opened_at = 0.0
        self._probes = 0  # admitted in half-open
        self._probe_successes = 0
        self.opened_count = 0

    def before(self) -> None:
        """Admit a call or raise BackendUnavailable. Every admitted call must report back."""
        if self.state == CLOSED:
            return
        now = self._clock()
        if self.state == OPEN:
            remaining = self.opened_at + self.policy.open_s - now
            if remaining > 0:
                raise BackendUnavailable(f"Triton replica {self.name} is failing; circuit open", retry_after_s=remaining)
            self.state, self._probes, self._probe_successes = HALF_OPEN, 0, 0
        if self._probes >= self.policy.half_open_probes:
            raise BackendUnavailable(f"Triton replica {self.name} is being probed; circuit half-open", retry_after_s=0.1)
        self._probes += 1

    def success(self) -> None:
        if self.state == HALF_OPEN:
            self._probe_successes += 1
            if self._probe_successes >= self.policy.half_open_probes:
                self.state = CLOSED
                self.failures = 0
            return
        self.failures = 0

    def failure(self) -> None:
        if self.state == HALF_OPEN:
            self._open()
            return
        self.failures += 1
        if self.state == CLOSED and self.failures >= self.policy.failure_threshold:
            self._open()

    def neutral(self) -> None:
        """An admitted call ended without saying anything about the replica (caller error, cancel)."""
        if self.state == HALF_OPEN and self._probes > 0:
            self._probes -= 1

    def record(self, err: BaseException | None) -> None:
        if err is None:
            self.success()
        elif counts_as_failure(err):
            self.failure()
        else:
            self.neutral()

    def _open(self) -> None:
        self.state = OPEN
        self.opened_at = self._clock()
        self.opened_count += 1


class BreakerSet:
    """One breaker per replica name (Triton target)."""

    def __init__(self, policy: BreakerPolicy = BreakerPolicy(), clock: Callable[[], float] = time.monotonic):
        self.policy = policy
        self._clock = clock
        self._breakers: dict[str, CircuitBreaker] = {}

    def __getitem__(self, replica: str) -> CircuitBreaker:
        breaker = self._breakers.get(replica)
        if breaker is None:
            breaker = self._breakers[replica] = CircuitBreaker(replica, self.policy, self._clock)
        return breaker

    def states(self) -> dict[str, str]:
        return {name: b.state for name, b in self._breakers.items()}
