"""Summarize a py-spy raw profile (``py-spy record --native -f raw -o prof.txt``) by where time goes.

    python -m loadtest.pyspy_summary prof.txt

Samples are wall-clock, all threads; idle waits (epoll) are counted apart so the shares of the
busy time are: kernel socket I/O, the inferplane Python code (server/, batching/), and the rest
(grpc's Cython layer, asyncio/uvloop, the interpreter).
"""

from __future__ import annotations

import collections
import sys

IDLE = ("epoll_wait", "epoll_pwait", "pthread_cond_wait", "pthread_cond_timedwait", "sem_wait", "nanosleep")
SOCKET = ("sendmsg", "recvmsg", "write (", "read (", "recv (", "send (", "writev", "readv")
OURS = ("(server/", "(batching/")


def summarize(path: str) -> dict:
    buckets: collections.Counter = collections.Counter()
    own: collections.Counter = collections.Counter()
    total = 0
    for line in open(path):
        stack, _, count = line.rstrip("\n").rpartition(" ")
        n = int(count)
        total += n
        frames = stack.split(";")
        leaf = frames[-1]
        own[leaf] += n
        if leaf.startswith(IDLE):
            buckets["idle"] += n
        elif leaf.startswith(SOCKET):
            buckets["socket syscalls"] += n
        elif any(tag in leaf for tag in OURS):
            buckets["inferplane python (self)"] += n
        else:
            buckets["grpc/asyncio/interpreter/other"] += n
    busy = total - buckets["idle"]
    return {
        "samples": total,
        "busy_share": busy / total if total else 0.0,
        "of_busy": {k: v / busy for k, v in buckets.items() if k != "idle" and busy},
        "top_self": [(name, n / total) for name, n in own.most_common(12)],
    }


def main() -> int:
    result = summarize(sys.argv[1])
    print(f"samples {result['samples']}, busy {result['busy_share']:.0%}")
    for name, share in sorted(result["of_busy"].items(), key=lambda kv: -kv[1]):
        print(f"  {share:6.1%} of busy  {name}")
    print("top self frames (share of all samples):")
    for name, share in result["top_self"]:
        print(f"  {share:6.1%}  {name[:110]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
