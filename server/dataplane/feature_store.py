"""Feature-store hook: before validation, a model whose config names a mapping
(``parameters { key: "inferplane.feature_store" value { string_value: '{...}' } }``) gets its feature
tensor fetched by entity key from an online store instead of sent by the caller.

The caller sends the entity keys (a BYTES tensor ``entity``, one key per row); the hook fetches the
mapped features of each key, builds the model's input ``input`` (FP32 ``[rows, len(features)]``, in
the mapping's order) and drops the entity tensor; validation then checks the request as usual.

- Stores: Redis hashes (the embedded default: key ``key_prefix + entity``, one field per feature,
  one pipelined ``HMGET`` per request) or Feast's online serving API over HTTP
  (``POST /get-online-features``; features named ``view:feature``).
- A deadline share: the fetch may take ``deadline_share`` of the caller's remaining deadline (and at
  most ``timeout_s``); a cache keeps each entity's features ``ttl_s`` seconds.
- The store down, slow past its share, or missing a key: **fail closed** by default —
  ``UNAVAILABLE`` / 503 naming the store (a missing key: ``INVALID_ARGUMENT`` naming it); with
  ``fail_open: true`` the missing features take ``default`` and the request goes on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import numpy as np

from server.dataplane import codecs
from server.errors import BackendUnavailable, InvalidRequest, Violation

log = logging.getLogger(__name__)

PARAMETER = "inferplane.feature_store"


@dataclass(frozen=True)
class FeatureMapping:
    entity: str  # the request's BYTES tensor of entity keys
    input: str  # the model input the features become
    features: tuple[str, ...]
    key_prefix: str = ""  # Redis: hash key = key_prefix + entity key; Feast: the entity's join key name
    deadline_share: float = 0.3
    timeout_s: float = 0.05
    ttl_s: float = 30.0
    fail_open: bool = False
    default: float = 0.0

    @classmethod
    def from_json(cls, text: str, model: str = "") -> "FeatureMapping":
        try:
            d = json.loads(text)
            mapping = cls(
                entity=str(d["entity"]), input=str(d["input"]), features=tuple(str(f) for f in d["features"]),
                key_prefix=str(d.get("key_prefix", "")), deadline_share=float(d.get("deadline_share", 0.3)),
                timeout_s=float(d.get("timeout_s", 0.05)), ttl_s=float(d.get("ttl_s", 30.0)),
                fail_open=bool(d.get("fail_open", False)), default=float(d.get("default", 0.0)),
            )  # fmt: skip
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"model '{model}': {PARAMETER} is not a feature mapping ({err})") from None
        if not mapping.features or not 0 < mapping.deadline_share <= 1 or mapping.timeout_s <= 0:
            raise ValueError(f"model '{model}': {PARAMETER} needs features, 0 < deadline_share <= 1 and timeout_s > 0")
        return mapping


class RedisFeatures:
    """Features as Redis hashes."""

    def __init__(self, url: str, timeout_s: float = 1.0):
        from redis import asyncio as aioredis

        self.name = url
        self.client = aioredis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)

    async def get(self, mapping: FeatureMapping, keys: list[str]) -> list[list[float | None]]:
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.hmget(mapping.key_prefix + key, list(mapping.features))
        rows = await pipe.execute()
        return [[None if v is None else float(v) for v in row] for row in rows]

    async def close(self) -> None:
        await self.client.aclose()


class FeastFeatures:
    """Feast's online feature server (``feast serve``): ``POST {url}/get-online-features``."""

    def __init__(self, url: str):
        self.name = url
        self.url = url.rstrip("/")
        self._session = aiohttp.ClientSession()

    async def get(self, mapping: FeatureMapping, keys: list[str]) -> list[list[float | None]]:
        body = {"features": list(mapping.features), "entities": {mapping.key_prefix or mapping.entity: keys}}
        async with self._session.post(f"{self.url}/get-online-features", json=body) as resp:
            if resp.status != 200:
                raise ConnectionError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
            data = await resp.json()
        names = data["metadata"]["feature_names"]
        columns = {n: r for n, r in zip(names, data["results"])}
        out = [[None] * len(mapping.features) for _ in keys]
        for j, feature in enumerate(mapping.features):
            column = columns.get(feature.split(":")[-1]) or columns.get(feature)
            if column is None:
                continue
            for i, (value, status) in enumerate(zip(column["values"], column.get("statuses", ["PRESENT"] * len(keys)))):
                out[i][j] = None if value is None or status != "PRESENT" else float(value)
        return out

    async def close(self) -> None:
        await self._session.close()


def store_for(url: str):
    """``redis://…`` / ``rediss://…`` -> Redis hashes; ``http(s)://…`` -> a Feast feature server."""
    if url.startswith(("redis://", "rediss://", "unix://")):
        return RedisFeatures(url)
    if url.startswith(("http://", "https://")):
        return FeastFeatures(url)
    raise ValueError(f"feature store URL {url!r}: expected redis://… (Redis hashes) or http://… (Feast)")


class FeatureFetcher:
    """Enriches requests of mapped models; one per data plane."""

    def __init__(self, store, clock: Callable[[], float] = time.monotonic):
        self.store = store
        self._clock = clock
        self._cache: dict[tuple[str, str], tuple[float, list[float | None]]] = {}
        self._mappings: dict[str, tuple[str, FeatureMapping]] = {}  # model -> (its parameter text, parsed)
        self.fetches = self.hits = self.failures = 0

    def mapping(self, model: str, params: dict[str, str]) -> FeatureMapping | None:
        text = params.get(PARAMETER)
        if not text:
            return None
        known = self._mappings.get(model)
        if known is None or known[0] != text:
            known = self._mappings[model] = (text, FeatureMapping.from_json(text, model))
        return known[1]

    async def enrich(self, request, mapping: FeatureMapping, timeout: float | None) -> None:
        """Replace the entity tensor of ``request`` (a ModelInferRequest) by the fetched feature tensor."""
        names = [t.name for t in request.inputs]
        if mapping.entity not in names:
            raise InvalidRequest(
                f"model '{request.model_name}' takes its features from the feature store: send the entity keys as BYTES input '{mapping.entity}'",
                [Violation(f"input '{mapping.entity}'", "missing: the entity keys (one per row)")],
            )
        i = names.index(mapping.entity)
        tensor = request.inputs[i]
        if tensor.datatype != "BYTES":
            raise InvalidRequest(f"input '{mapping.entity}': entity keys are BYTES, got {tensor.datatype}",
                                 [Violation(f"input '{mapping.entity}' datatype", f"expected BYTES, got {tensor.datatype}")])  # fmt: skip
        raw = request.raw_input_contents[i] if request.raw_input_contents else None
        keys = [k.decode() for k in (codecs.deserialize_bytes(raw) if raw is not None else tensor.contents.bytes_contents)]
        values = await self._values(request.model_name, mapping, keys, timeout)
        array = np.array([[mapping.default if v is None else v for v in row] for row in values], dtype=np.float32).reshape(len(keys), len(mapping.features))
        datatype, shape, data = codecs.from_numpy(array)
        del request.inputs[i]
        if request.raw_input_contents:
            del request.raw_input_contents[i]
        added = request.inputs.add(name=mapping.input, datatype=datatype, shape=shape)
        if request.raw_input_contents or raw is not None:
            request.raw_input_contents.append(data)
        else:
            added.contents.fp32_contents.extend(array.ravel().tolist())

    async def _values(self, model: str, mapping: FeatureMapping, keys: list[str], timeout: float | None) -> list[list[float | None]]:
        now = self._clock()
        out: list[list[float | None] | None] = []
        missing = []
        for key in keys:
            cached = self._cache.get((model, key))
            if cached is not None and cached[0] > now:
                self.hits += 1
                out.append(cached[1])
            else:
                out.append(None)
                missing.append(key)
        if missing:
            budget = mapping.timeout_s if timeout is None else min(mapping.timeout_s, timeout * mapping.deadline_share)
            self.fetches += 1
            try:
                fetched = await asyncio.wait_for(self.store.get(mapping, missing), budget)
            except Exception as err:  # down, slow past its share of the deadline, or a bad answer
                self.failures += 1
                why = f"no answer within {budget * 1000:.0f} ms" if isinstance(err, (asyncio.TimeoutError, TimeoutError)) else str(err) or type(err).__name__
                if not mapping.fail_open:
                    raise BackendUnavailable(f"feature store {self.store.name} unavailable for model '{model}': {why}", retry_after_s=1.0) from None
                log.warning("feature store %s unavailable for model %s (%s): defaults used (fail open)", self.store.name, model, why)
                fetched = [[None] * len(mapping.features) for _ in missing]
            else:
                expires = now + mapping.ttl_s
                for key, row in zip(missing, fetched):
                    if all(v is not None for v in row):
                        self._cache[(model, key)] = (expires, row)
            by_key = dict(zip(missing, fetched))
            out = [row if row is not None else by_key[key] for key, row in zip(keys, out)]
        if not mapping.fail_open:
            for key, row in zip(keys, out):
                absent = [f for f, v in zip(mapping.features, row) if v is None]
                if absent:
                    raise InvalidRequest(f"feature store {self.store.name} has no {', '.join(absent)} for entity '{key}' (model '{model}')",
                                         [Violation(f"input '{mapping.entity}'", f"entity '{key}' unknown to the feature store")])  # fmt: skip
        return out

    async def close(self) -> None:
        await self.store.close()
