"""The committed generated code equals what proto/generate.py makes from proto/ now."""

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _load_generator():
    spec = importlib.util.spec_from_file_location("proto_generate", REPO / "proto" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_code_is_fresh(tmp_path):
    generator = _load_generator()
    fresh = tmp_path / "protogen"
    generator.generate(fresh)
    committed = REPO / "server" / "protogen"
    fresh_files = {p.relative_to(fresh): p.read_text() for p in fresh.rglob("*") if p.is_file()}
    committed_files = {
        p.relative_to(committed): p.read_text()
        for p in committed.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert sorted(fresh_files) == sorted(committed_files), "run `make proto`"
    stale = [str(name) for name, text in fresh_files.items() if committed_files[name] != text]
    assert not stale, f"stale generated files (run `make proto`): {stale}"


def test_generated_messages_coexist_with_tritonclient():
    """Our messages live in a private pool; tritonclient's identical names must still load."""
    from tritonclient.grpc import service_pb2 as triton_pb

    from server.protogen.inference import grpc_service_pb2 as pb

    ours = pb.ModelInferRequest(model_name="m")
    ours.inputs.add(name="x", datatype="FP32", shape=[1, 2])
    ours.raw_input_contents.append(b"\x00" * 8)
    theirs = triton_pb.ModelInferRequest.FromString(ours.SerializeToString())
    assert theirs.inputs[0].shape == [1, 2]
    assert pb.ModelInferRequest.FromString(theirs.SerializeToString()) == ours
