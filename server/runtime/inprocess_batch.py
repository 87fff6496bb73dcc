"""Group commit for the in-process Triton: a merged batch goes to Triton as one request built from
the members' own buffers (each caller's bytes are one more chunk of the merged input: no copy), and
the answer is cut back into one serialized response per member by rows of Triton's output buffers.

``InProcessTriton.batch_codec()`` hands this to the coalescer (``batching.coalescer.BatchCodec``);
``InProcessTriton.send_batch`` sends what it merges. The gRPC backend's codec
(``server.dataplane.batch_codec``) does the same with serialized protobuf requests.
"""

from __future__ import annotations

from dataclasses import dataclass

from server.dataplane.batch_codec import ProtobufBatchCodec
from server.protogen.inference import grpc_service_pb2 as pb
from server.runtime.capi_codec import Tensor, raw_output_field


@dataclass(slots=True)
class MergedBatch:
    model: str
    version: str
    tensors: list[Tensor]
    outputs: tuple[str, ...]


class TensorBatchCodec(ProtobufBatchCodec):
    """Which requests merge and how many rows each carries: as the protobuf codec; the merge and the
    split work on the members' buffers instead of one serialized request."""

    @staticmethod
    def merge(requests: list[pb.ModelInferRequest]) -> MergedBatch:
        first = requests[0]
        total = sum(int(r.inputs[0].shape[0]) for r in requests)
        tensors = [
            Tensor(t.name, t.datatype, [total, *t.shape[1:]], [r.raw_input_contents[i] for r in requests])
            for i, t in enumerate(first.inputs)
        ]
        return MergedBatch(first.model_name, first.model_version, tensors, tuple(o.name for o in first.outputs))

    @staticmethod
    def split(result, requests: list[pb.ModelInferRequest], rows: list[int]) -> list[bytes]:
        total = sum(rows)
        sizes = []
        for out in result.outputs:
            if not out.shape or out.shape[0] != total or len(out.data) % total:
                raise ValueError(f"output '{out.name}' of shape {list(out.shape)} cannot be split into {total} rows")
            sizes.append(len(out.data) // total)
        answers, start = [], 0
        for request, n in zip(requests, rows):
            head = pb.ModelInferResponse(model_name=result.model_name, model_version=result.model_version, id=request.id)
            parts = [b""]
            for out, size in zip(result.outputs, sizes):
                head.outputs.add(name=out.name, datatype=out.datatype, shape=[n, *out.shape[1:]])
                parts += raw_output_field(memoryview(out.data)[start * size : (start + n) * size])
            parts[0] = head.SerializeToString()
            answers.append(b"".join(parts))
            start += n
        return answers


CODEC = TensorBatchCodec()
