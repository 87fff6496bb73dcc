"""Shared-memory cleanup picks exactly the regions of the owners it is asked about; the supervisor's restart waits only in a crash loop."""

import os

from server.runtime.supervisor import _is_dead, remove_shm_regions


def test_removes_only_selected_owners(tmp_path):
    mine = tmp_path / f"inferplane_{os.getpid()}_1_abc"
    dead = tmp_path / "inferplane_999999999_2_def"
    foreign = tmp_path / "triton_python_backend_shm_region_xyz"
    for f in (mine, dead, foreign):
        f.write_bytes(b"x")
    removed = remove_shm_regions(_is_dead, shm=tmp_path)
    assert removed == [dead.name]
    assert mine.exists() and foreign.exists()
    assert remove_shm_regions(lambda pid: pid == os.getpid(), shm=tmp_path) == [mine.name]


def test_a_restart_waits_only_in_a_crash_loop():
    """A Triton's death restarts it at once (the first, or after a stable run: the drills' kill -9);
    one that dies again within ``stable_s`` of its restart (a model crashing it on every load)
    waits, the wait doubling up to the cap, and a stable run starts it over."""
    from server.runtime.supervisor import FIRST_BACKOFF_S, restart_wait

    assert restart_wait(0.5, False, FIRST_BACKOFF_S, 10.0, 8.0) == (0.0, FIRST_BACKOFF_S)  # the first death, however soon
    assert restart_wait(60.0, True, 4.0, 10.0, 8.0) == (0.0, FIRST_BACKOFF_S)  # after a stable run: at once, backoff reset
    waits, backoff = [], FIRST_BACKOFF_S
    for _ in range(8):  # dying 1 s after each restart
        wait, backoff = restart_wait(1.0, True, backoff, 10.0, 8.0)
        waits.append(wait)
    assert waits == [0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
