"""The tenancy side of a serving process, built once from the settings: the gatekeeper (API keys
from the store when auth is on, one open tenant when off), the usage meter and the store."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from server.settings import Settings
from server.tenancy.identity import Gatekeeper, KeyRing
from server.tenancy.quota_policy import Quota
from server.tenancy.metering import Meter
from server.tenancy.store import TenancyStore

log = logging.getLogger(__name__)


@dataclass
class Tenancy:
    gate: Gatekeeper
    meter: object | None = None  # server.tenancy.metering.Meter (auth on)
    store: object | None = None  # server.tenancy.store.TenancyStore (auth on)

    async def run(self, settings: Settings) -> None:
        """Keep the key ring fresh (revocations take effect within ``auth_refresh_s``)."""
        if self.store is not None:
            await self.gate.refresh_forever(self.store.snapshot, settings.auth_refresh_s)


def default_quota(settings: Settings) -> Quota:
    return Quota(settings.quota_rps, settings.quota_rpm, settings.quota_tpm, settings.quota_concurrency)


def open_tenancy(settings: Settings) -> Tenancy:
    """No keys: every caller is the open tenant (``--auth off``, and a parent of workers, which serves nothing)."""
    return Tenancy(Gatekeeper(None, default_quota(settings)))


async def build_tenancy(settings: Settings) -> Tenancy:
    if not settings.auth:
        log.warning("auth off: every caller is the open tenant and sees every model (development mode)")
        return open_tenancy(settings)

    store = await asyncio.to_thread(TenancyStore, settings.tenancy_url)
    ring = KeyRing(settings.key_pepper.get_secret_value().encode())
    ring.load(*await asyncio.to_thread(store.snapshot))
    log.info("auth on: %d API keys of %d tenants", len(ring), len(ring.tenants))
    meter = Meter(store.write_usage, settings.usage_flush_s)
    meter.start()
    return Tenancy(Gatekeeper(ring, default_quota(settings)), meter, store)
