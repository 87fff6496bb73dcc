"""The GPU checks (tests/gpu/): every test here is marked ``gpu`` and skipped, with the reason, on a
machine without an NVIDIA GPU; ``tests/gpu/run.sh`` sets a GPU machine up and runs them."""

from __future__ import annotations

import pytest

from server.control.registry.backend_configs import observe_gpus

NO_GPU = "needs an NVIDIA GPU (no /dev/nvidia0 here): run tests/gpu/run.sh on a machine with one"


def pytest_collection_modifyitems(config, items):
    if observe_gpus() > 0:
        return
    for item in items:
        # the mark, not the keyword: a parameter id "gpu" (tests/unit/test_deploy.py's overlays) is a keyword too,
        # and this hook sees every item of the session
        if item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.skip(reason=NO_GPU))
