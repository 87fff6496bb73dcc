"""The versioned price list cost is computed from: ``deploy/prices/*.yaml``, one file per ``version:``,
USD per replica-hour by hardware class and capacity type (``on_demand`` | ``spot``).

Prices are data, never constants in code: a window is reproduced with the file that was current then,
and every cost report names the version it used.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

PRICES_DIR = Path(__file__).resolve().parents[3] / "deploy" / "prices"
CAPACITY_TYPES = ("on_demand", "spot")


@dataclass(frozen=True)
class PriceBook:
    version: str
    per_hour: dict[str, dict[str, float]]  # hardware class -> capacity type -> USD per replica-hour

    def hourly(self, hardware: str, capacity_type: str = "on_demand") -> float:
        if hardware not in self.per_hour:
            raise ValueError(f"price list {self.version} has no hardware class {hardware!r} (classes: {', '.join(sorted(self.per_hour))})")
        by_type = self.per_hour[hardware]
        if capacity_type not in by_type:
            raise ValueError(f"price list {self.version} has no {capacity_type!r} price for {hardware!r} (types: {', '.join(sorted(by_type))})")
        return by_type[capacity_type]

    def per_second(self, hardware: str, capacity_type: str = "on_demand") -> float:
        return self.hourly(hardware, capacity_type) / 3600.0


def parse_prices(doc: dict, source: str = "price list") -> PriceBook:
    version = doc.get("version")
    if not version:
        raise ValueError(f"{source}: no `version:`")
    table = doc.get("prices")
    if not isinstance(table, dict) or not table:
        raise ValueError(f"{source}: no `prices:` table")
    per_hour: dict[str, dict[str, float]] = {}
    for hardware, by_type in table.items():
        if not isinstance(by_type, dict) or "on_demand" not in by_type:
            raise ValueError(f"{source}: {hardware} needs an on_demand price")
        unknown = set(by_type) - set(CAPACITY_TYPES)
        if unknown:
            raise ValueError(f"{source}: {hardware} has unknown capacity types {sorted(unknown)} (known: {', '.join(CAPACITY_TYPES)})")
        per_hour[str(hardware)] = {k: float(v) for k, v in by_type.items()}
        if any(v < 0 for v in per_hour[str(hardware)].values()):
            raise ValueError(f"{source}: {hardware} has a negative price")
    return PriceBook(str(version), per_hour)


def load_prices(path: Path | str | None = None) -> PriceBook:
    """``path``, or the newest version under ``deploy/prices/`` (file names sort by version)."""
    if path is None:
        files = sorted(PRICES_DIR.glob("*.yaml"))
        if not files:
            raise ValueError(f"no price list under {PRICES_DIR}: pass --prices FILE")
        path = files[-1]
    path = Path(path)
    return parse_prices(yaml.safe_load(path.read_text()) or {}, str(path))
