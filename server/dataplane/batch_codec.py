"""The protobuf side of request coalescing (``batching.coalescer``): which OIP requests may merge,
how to concatenate them along the batch dimension and cut Triton's answer back by rows, all on
raw tensor bytes (never decoded).
"""

from __future__ import annotations

from server.protogen.inference import grpc_service_pb2 as pb


class ProtobufBatchCodec:
    """``batching.coalescer.BatchCodec`` over ``ModelInferRequest`` messages."""

    @staticmethod
    def key(request: pb.ModelInferRequest) -> tuple | None:
        return merge_key(request)

    @staticmethod
    def rows(request: pb.ModelInferRequest) -> int:
        return int(request.inputs[0].shape[0])

    @staticmethod
    def merge(requests: list[pb.ModelInferRequest]) -> bytes:
        return merge_requests(requests).SerializeToString()

    @staticmethod
    def split(response: bytes, requests: list[pb.ModelInferRequest], rows: list[int]) -> list[bytes]:
        return split_response(pb.ModelInferResponse.FromString(response), requests, rows)


CODEC = ProtobufBatchCodec()


def merge_key(request: pb.ModelInferRequest) -> tuple | None:
    """Requests with equal keys can be merged; None: this request is never merged."""
    if request.parameters or not request.raw_input_contents:
        return None
    inputs = tuple((t.name, t.datatype, tuple(t.shape[1:])) for t in request.inputs)
    if any(t.parameters for t in request.inputs) or any(dt == "BYTES" for _, dt, _ in inputs):
        return None
    outputs = tuple(o.name for o in request.outputs)
    if any(o.parameters for o in request.outputs):
        return None
    return (request.model_name, request.model_version, inputs, outputs)


def merge_requests(requests: list[pb.ModelInferRequest]) -> pb.ModelInferRequest:
    """One request whose inputs are the members' inputs concatenated along dimension 0."""
    first = requests[0]
    merged = pb.ModelInferRequest(model_name=first.model_name, model_version=first.model_version)
    total = sum(int(r.inputs[0].shape[0]) for r in requests)
    for index, tensor in enumerate(first.inputs):
        merged.inputs.add(name=tensor.name, datatype=tensor.datatype, shape=[total, *tensor.shape[1:]])
        merged.raw_input_contents.append(b"".join(r.raw_input_contents[index] for r in requests))
    for output in first.outputs:
        merged.outputs.add(name=output.name)
    return merged


def split_response(response: pb.ModelInferResponse, requests: list[pb.ModelInferRequest], rows: list[int]) -> list[bytes]:
    """Cut Triton's merged answer back into one serialized response per member, by rows."""
    total = sum(rows)
    slices = []
    for index, tensor in enumerate(response.outputs):
        data = response.raw_output_contents[index]
        if not tensor.shape or tensor.shape[0] != total or len(data) % total:
            raise ValueError(f"output '{tensor.name}' of shape {list(tensor.shape)} cannot be split into {total} rows")
        slices.append((tensor, len(data) // total, data))
    out = []
    offset = 0
    for request, n in zip(requests, rows):
        answer = pb.ModelInferResponse(model_name=response.model_name, model_version=response.model_version, id=request.id)
        for tensor, row_bytes, data in slices:
            answer.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=[n, *tensor.shape[1:]])
            answer.raw_output_contents.append(data[offset * row_bytes : (offset + n) * row_bytes])
        offset += n
        out.append(answer.SerializeToString())
    return out
