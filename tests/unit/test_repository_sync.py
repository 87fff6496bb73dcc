"""``python -m server.runtime.repository_sync``: copies a repository prefix from an fsspec URL (a
local folder here, as ``file://``) into the pod's model folder; only the named models; idempotent;
nothing written outside the destination; a missing model is a clear error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from server.runtime.repository_sync import SyncError, main, sync


def _repository(root: Path) -> Path:
    for model, files in {
        "fraud_xgboost": {"config.pbtxt": b"name: 'fraud_xgboost'\n", "1/model.json": b"{}" * 1000, "1/model.py": b"# adapter\n"},
        "mlp_classifier": {"config.pbtxt": b"name: 'mlp_classifier'\n", "1/model.onnx": bytes(range(256)) * 64},
        "tiny_llama": {"config.pbtxt": b"name: 'tiny_llama'\n", "1/weights/model.safetensors": b"\x00" * 4096},
    }.items():
        for rel, data in files.items():
            path = root / model / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
    return root


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_copies_the_named_models_from_a_file_url(tmp_path):
    src = _repository(tmp_path / "store" / "model_repository")
    dest = tmp_path / "models"
    result = sync(f"file://{src}", dest, ["fraud_xgboost", "tiny_llama"])
    assert result["models"] == ["fraud_xgboost", "tiny_llama"] and result["copied"] == 5
    expected = {k: v for k, v in _tree(src).items() if not k.startswith("mlp_classifier/")}
    assert _tree(dest) == expected
    assert not list(dest.rglob("*.partial"))


def test_star_copies_everything_and_a_second_run_copies_nothing(tmp_path):
    src = _repository(tmp_path / "src")
    dest = tmp_path / "models"
    assert sync(str(src), dest, ["*"])["copied"] == 7
    again = sync(f"file://{src}", dest, None)
    assert again == {"models": ["fraud_xgboost", "mlp_classifier", "tiny_llama"], "copied": 0, "kept": 7}
    assert _tree(dest) == _tree(src)


def test_a_changed_file_is_copied_again(tmp_path):
    src = _repository(tmp_path / "src")
    dest = tmp_path / "models"
    sync(str(src), dest)
    (src / "mlp_classifier" / "config.pbtxt").write_bytes(b"name: 'mlp_classifier' # v2, longer\n")
    assert sync(str(src), dest)["copied"] == 1
    assert (dest / "mlp_classifier" / "config.pbtxt").read_bytes().endswith(b"longer\n")


def test_missing_model_and_missing_source_are_errors_that_name_them(tmp_path):
    src = _repository(tmp_path / "src")
    with pytest.raises(SyncError, match="no model nope .*it has: fraud_xgboost, mlp_classifier, tiny_llama"):
        sync(str(src), tmp_path / "models", ["fraud_xgboost", "nope"])
    with pytest.raises(SyncError, match="is not a folder"):
        sync(str(tmp_path / "absent"), tmp_path / "models", ["fraud_xgboost"])
    with pytest.raises(SyncError, match="not a plain relative path"):
        sync(str(src), tmp_path / "models", [".."])


def test_module_entry_exit_codes(tmp_path, capsys):
    src = _repository(tmp_path / "src")
    assert main(["--source", f"file://{src}", "--dest", str(tmp_path / "a"), "--models", "mlp_classifier"]) == 0
    assert _tree(tmp_path / "a") == {k: v for k, v in _tree(src).items() if k.startswith("mlp_classifier/")}
    assert main(["--source", str(src), "--dest", str(tmp_path / "b"), "--models", "ghost"]) == 2
    assert "no model ghost" in capsys.readouterr().err


def test_runs_as_python_dash_m(tmp_path):
    src = _repository(tmp_path / "src")
    out = subprocess.run(
        [sys.executable, "-m", "server.runtime.repository_sync", f"--source=file://{src}", f"--dest={tmp_path / 'm'}", "--models=*"],
        capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "7 files copied" in out.stderr
    assert _tree(tmp_path / "m") == _tree(src)


def test_an_empty_bucket_is_no_error_for_every_model(tmp_path):
    """The first rollout finds no repository yet: '*' copies nothing (it crash-looped on "is not a folder")."""
    assert sync(str(tmp_path / "absent"), tmp_path / "models") == {"models": [], "copied": 0, "kept": 0}
    assert sync(str(tmp_path / "absent"), tmp_path / "models", ["*"])["models"] == []
    assert (tmp_path / "models").is_dir()
