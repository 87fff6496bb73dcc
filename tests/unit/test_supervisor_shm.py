"""Shared-memory cleanup picks exactly the regions of the owners it is asked about."""

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
