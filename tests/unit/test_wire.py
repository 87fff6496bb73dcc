"""The protobuf wire helpers (server/dataplane/wire.py) against protobuf's own parser."""

from __future__ import annotations

import pytest

from server.dataplane import wire
from server.protogen.inference import grpc_service_pb2 as pb


@pytest.mark.parametrize("value", [0, 1, 127, 128, 300, 1 << 35, (1 << 63) - 1])
def test_varint_reads_back(value):
    data = wire.varint(value)
    assert wire.read_varint(data + b"rest", 0) == (value, len(data))


def test_varint_of_a_negative_int64_is_ten_bytes():
    assert wire.varint(-1) == b"\xff" * 9 + b"\x01"
    assert wire.varint(300) == b"\xac\x02"
    parsed = pb.ModelInferRequest.FromString(wire.tag(2, 2) + wire.varint(1) + b"7")  # field 2: model_version
    assert parsed.model_version == "7"


def test_rename_overrides_name_and_version_of_a_request_and_an_answer():
    request = pb.ModelInferRequest(model_name="composite", model_version="3", id="r")
    renamed = pb.ModelInferRequest.FromString(wire.rename(request.SerializeToString(), "part", ""))
    assert (renamed.model_name, renamed.model_version, renamed.id) == ("part", "", "r")
    answer = pb.ModelInferResponse(model_name="part", model_version="1", id="r")
    back = pb.ModelInferResponse.FromString(wire.rename(answer.SerializeToString(), "composite", "3"))
    assert (back.model_name, back.model_version, back.id) == ("composite", "3", "r")
    assert wire.request_model(wire.rename(request.SerializeToString(), "part")) == "part"  # the occurrence a parser keeps
