"""Continuous-batching admission: which waiting sequences join the running batch at this step.

Pure and standard-library only (copied beside the LLM engine adapter, imported as
``llm_scheduler``). The engine calls, once per decode step:

1. ``submit`` for each new request (rejected at once when it could never fit the KV budget),
2. ``finish`` for each sequence that ended (stop, length, cancel, deadline) or left the queue,
3. ``schedule`` to learn which waiting sequences to prefill and add to the batch now.

Policy: by priority (lower first: the frontend maps the caller's plan, paid tiers first), then first
come, first served, no skipping (a big request at the head of the queue is never starved by small ones
behind it, of its priority or a lower one). A sequence is admitted when the batch has a free slot, its
worst case (``prompt + max_tokens``) fits next to the reservations of the running sequences,
and the prompt tokens admitted this step stay under ``max_prefill_tokens`` (at least one
sequence is always admitted when there is room, so a long prompt cannot stall). Reserving the
worst case means a running sequence never needs preemption.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


class NeverFits(ValueError):
    """The sequence needs more KV tokens than the whole budget (or the context window)."""


@dataclass(frozen=True)
class SchedulerConfig:
    budget_tokens: int  # KV tokens shared by all running sequences
    max_running: int = 16  # sequences in the batch at once
    max_prefill_tokens: int = 4096  # prompt tokens admitted in one step (beyond the first sequence)
    max_waiting: int = 1024  # queue length before new requests are refused
    max_context: int = 0  # the model's context window (0: unbounded)

    def __post_init__(self) -> None:
        if self.budget_tokens < 1 or self.max_running < 1 or self.max_prefill_tokens < 1 or self.max_waiting < 0:
            raise ValueError(f"invalid scheduler config {self}")


@dataclass
class Sequence:
    id: str
    prompt_tokens: int
    max_tokens: int
    submitted_step: int = 0
    admitted_step: int | None = None
    priority: int = 0  # lower is admitted first

    @property
    def need(self) -> int:
        return self.prompt_tokens + self.max_tokens


def _rank(seq: Sequence) -> int:
    return seq.priority


class QueueFull(RuntimeError):
    """More sequences are waiting than ``max_waiting``."""


@dataclass
class SchedulerStats:
    submitted: int = 0
    admitted: int = 0
    finished: int = 0
    rejected: int = 0
    max_waiting_seen: int = 0
    max_running_seen: int = 0


@dataclass
class ContinuousBatchScheduler:
    config: SchedulerConfig
    step: int = 0
    waiting: "OrderedDict[str, Sequence]" = field(default_factory=OrderedDict)
    running: dict[str, Sequence] = field(default_factory=dict)
    reserved: int = 0
    stats: SchedulerStats = field(default_factory=SchedulerStats)

    def check(self, prompt_tokens: int, max_tokens: int) -> None:
        """Raise NeverFits when a sequence of this size could never be admitted."""
        need = prompt_tokens + max_tokens
        c = self.config
        if c.max_context and need > c.max_context:
            raise NeverFits(
                f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = {need} exceeds the model's "
                f"context window of {c.max_context} tokens"
            )
        if need > c.budget_tokens:
            raise NeverFits(
                f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = {need} exceeds the KV-cache "
                f"budget of {c.budget_tokens} tokens"
            )

    def submit(self, seq_id: str, prompt_tokens: int, max_tokens: int, priority: int = 0) -> Sequence:
        self.check(prompt_tokens, max_tokens)
        if seq_id in self.waiting or seq_id in self.running:
            raise ValueError(f"sequence {seq_id!r} is already scheduled")
        if len(self.waiting) >= self.config.max_waiting:
            self.stats.rejected += 1
            raise QueueFull(f"{len(self.waiting)} sequences are already waiting for the KV budget")
        seq = Sequence(seq_id, int(prompt_tokens), int(max_tokens), submitted_step=self.step, priority=int(priority))
        self.waiting[seq_id] = seq
        self.stats.submitted += 1
        self.stats.max_waiting_seen = max(self.stats.max_waiting_seen, len(self.waiting))
        return seq

    def schedule(self) -> list[Sequence]:
        """The waiting sequences to admit now, by priority then arrival; they count as running from here on."""
        admitted: list[Sequence] = []
        prefill = 0
        c = self.config
        while self.waiting and len(self.running) < c.max_running:
            seq = min(self.waiting.values(), key=_rank)  # the first of the lowest priority (min is stable)
            if self.reserved + seq.need > c.budget_tokens:
                break  # the head waits for room; nothing behind it jumps ahead
            if admitted and prefill + seq.prompt_tokens > c.max_prefill_tokens:
                break
            del self.waiting[seq.id]
            seq.admitted_step = self.step
            self.running[seq.id] = seq
            self.reserved += seq.need
            prefill += seq.prompt_tokens
            admitted.append(seq)
        self.stats.admitted += len(admitted)
        self.stats.max_running_seen = max(self.stats.max_running_seen, len(self.running))
        return admitted

    def finish(self, seq_id: str) -> Sequence | None:
        """Release a running sequence's reservation, or drop a waiting one; unknown ids are ignored."""
        seq = self.running.pop(seq_id, None)
        if seq is not None:
            self.reserved -= seq.need
            self.stats.finished += 1
            return seq
        seq = self.waiting.pop(seq_id, None)
        if seq is not None:
            self.stats.finished += 1
        return seq

    def advance(self) -> int:
        """One decode step happened."""
        self.step += 1
        return self.step

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def snapshot(self) -> dict:
        return {
            "step": self.step,
            "running": len(self.running),
            "waiting": len(self.waiting),
            "reserved_tokens": self.reserved,
            "budget_tokens": self.config.budget_tokens,
            **vars(self.stats),
        }
