"""What a deploy or a rollback answers (the model deployer's and the composite deployer's)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class DeployResult:
    endpoint: str
    version: int
    previous: int | None
    switch_ms: float  # from the call to the traffic switch (rollback: no reload inside the grace period)
    total_ms: float
    loaded_versions: list[int]
    reloaded: bool  # Triton loaded something (False: only traffic moved)
    message: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
