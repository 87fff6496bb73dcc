"""The feature-store stage against a real Redis (the redis_url fixture's redis-server): the store up
(features by entity key become the model's input tensor, cached for the TTL), slow (CLIENT PAUSE holds
every command past the fetch's deadline share), and down (a closed port) — fail closed naming the store,
or fail open with defaults; a key the store does not know, and a bad mapping."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import redis

from server.dataplane import codecs
from server.dataplane.feature_store import PARAMETER, FeatureFetcher, FeatureMapping, RedisFeatures, store_for
from server.errors import BackendUnavailable, InvalidRequest, grpc_status, http_error
from server.protogen.inference import grpc_service_pb2 as pb
from server.runtime.supervisor import free_port

MAPPING = {"entity": "card_id", "input": "features", "features": ["amount_avg_7d", "declines_24h", "cvv_failures_24h"],
           "key_prefix": "card:", "ttl_s": 30, "timeout_s": 0.2}  # fmt: skip


def _request(*keys: str) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name="fraud")
    req.inputs.add(name="card_id", datatype="BYTES", shape=[len(keys), 1])
    req.raw_input_contents.append(codecs.serialize_bytes([k.encode() for k in keys]))
    return req


@pytest.fixture
def store(redis_url):
    client = redis.Redis.from_url(redis_url)
    client.hset("card:c1", mapping={"amount_avg_7d": 12.5, "declines_24h": 1, "cvv_failures_24h": 0})
    client.hset("card:c2", mapping={"amount_avg_7d": 99.0, "declines_24h": 4, "cvv_failures_24h": 2})
    yield redis_url, client
    client.delete("card:c1", "card:c2")
    client.close()


def test_features_by_entity_key_become_the_input_tensor_and_are_cached(store):
    url, client = store
    mapping = FeatureMapping.from_json(json.dumps(MAPPING))
    now = [100.0]

    async def run():
        fetcher = FeatureFetcher(store_for(url), clock=lambda: now[0])
        req = _request("c1", "c2")
        await fetcher.enrich(req, mapping, timeout=1.0)
        assert [t.name for t in req.inputs] == ["features"] and req.inputs[0].datatype == "FP32" and list(req.inputs[0].shape) == [2, 3]
        got = np.frombuffer(req.raw_input_contents[0], np.float32).reshape(2, 3)
        assert got.tolist() == [[12.5, 1.0, 0.0], [99.0, 4.0, 2.0]]
        client.hset("card:c1", "amount_avg_7d", 50.0)  # within the TTL the cached value answers
        req = _request("c1")
        await fetcher.enrich(req, mapping, timeout=1.0)
        assert np.frombuffer(req.raw_input_contents[0], np.float32)[0] == 12.5 and fetcher.hits == 1
        now[0] += 31  # past it, the store's
        req = _request("c1")
        await fetcher.enrich(req, mapping, timeout=1.0)
        assert np.frombuffer(req.raw_input_contents[0], np.float32)[0] == 50.0
        with pytest.raises(InvalidRequest, match="has no amount_avg_7d, declines_24h, cvv_failures_24h for entity 'nope'"):
            await fetcher.enrich(_request("nope"), mapping, timeout=1.0)
        with pytest.raises(InvalidRequest, match="send the entity keys as BYTES input 'card_id'"):
            await fetcher.enrich(pb.ModelInferRequest(model_name="fraud"), mapping, timeout=1.0)
        await fetcher.close()

    asyncio.run(run())


def test_a_slow_store_past_its_deadline_share_fails_closed_or_open(store):
    """CLIENT PAUSE holds every command 1.5 s; the fetch may take 0.3 x 0.5 s = 150 ms of the deadline."""
    url, client = store
    closed = FeatureMapping.from_json(json.dumps({**MAPPING, "timeout_s": 1.0}))
    open_ = FeatureMapping.from_json(json.dumps({**MAPPING, "timeout_s": 1.0, "fail_open": True, "default": -1}))

    async def run():
        fetcher = FeatureFetcher(RedisFeatures(url, timeout_s=5.0))
        await fetcher.store.client.ping()  # connected before the pause
        client.execute_command("CLIENT", "PAUSE", "1500", "ALL")
        with pytest.raises(BackendUnavailable) as err:
            await fetcher.enrich(_request("c1"), closed, timeout=0.5)
        assert f"feature store {url} unavailable for model 'fraud': no answer within 150 ms" in err.value.message
        assert grpc_status(err.value).code.name == "UNAVAILABLE" and http_error(err.value)[0] == 503
        req = _request("c2")
        await fetcher.enrich(req, open_, timeout=0.5)
        assert np.frombuffer(req.raw_input_contents[0], np.float32).tolist() == [-1.0, -1.0, -1.0]
        client.execute_command("CLIENT", "UNPAUSE")
        await fetcher.close()

    asyncio.run(run())


def test_a_store_that_is_down_fails_closed_naming_it_or_open_with_defaults():
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    closed = FeatureMapping.from_json(json.dumps(MAPPING))
    open_ = FeatureMapping.from_json(json.dumps({**MAPPING, "fail_open": True}))

    async def run():
        fetcher = FeatureFetcher(store_for(url))
        with pytest.raises(BackendUnavailable, match=f"feature store {url} unavailable for model 'fraud'"):
            await fetcher.enrich(_request("c1"), closed, timeout=1.0)
        req = _request("c1", "c2")
        await fetcher.enrich(req, open_, timeout=1.0)
        assert np.frombuffer(req.raw_input_contents[0], np.float32).tolist() == [0.0] * 6
        assert fetcher.failures == 2
        await fetcher.close()

    asyncio.run(run())


def test_mappings_are_read_from_the_model_config_and_checked():
    fetcher = FeatureFetcher(store=None)
    assert fetcher.mapping("m", {}) is None
    assert fetcher.mapping("m", {PARAMETER: json.dumps(MAPPING)}).features == tuple(MAPPING["features"])
    with pytest.raises(ValueError, match="not a feature mapping"):
        fetcher.mapping("bad", {PARAMETER: "{}"})
    with pytest.raises(ValueError, match="deadline_share"):
        FeatureMapping.from_json(json.dumps({**MAPPING, "deadline_share": 2}))
    with pytest.raises(ValueError, match="expected redis"):
        store_for("memcached://x")
