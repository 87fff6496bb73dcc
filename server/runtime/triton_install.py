"""Where the embedded Triton lives inside the installed ``nvidia-pytriton`` wheel, and how to run it.

The wheel ships a real ``tritonserver`` (2.51), the Python backend, one backend stub per
Python minor version and the shared libraries they link against. Running them needs:

* a backend directory whose ``python/`` folder holds ``libtriton_python.so`` and the stub
  built for *this* interpreter;
* ``PATH`` starting with this interpreter's ``bin`` (the stub starts ``python3`` from PATH;
  PYTHONPATH is ignored), so model processes import the packages of this environment;
* ``LD_LIBRARY_PATH`` with the interpreter's ``LIBDIR`` (libpython) and the wheel's
  ``nvidia_pytriton.libs``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path


class TritonNotInstalled(RuntimeError):
    """The nvidia-pytriton wheel (or a part of it) is missing."""


@dataclass(frozen=True)
class TritonInstallation:
    root: Path  # .../site-packages/pytriton/tritonserver
    libs: Path  # .../site-packages/nvidia_pytriton.libs

    @property
    def binary(self) -> Path:
        return self.root / "bin" / "tritonserver"

    @property
    def python_backend(self) -> Path:
        return self.root / "backends" / "python"

    @property
    def caches(self) -> Path:
        return self.root / "caches"

    @property
    def stub(self) -> Path:
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        return self.root / "python_backend_stubs" / version / "triton_python_backend_stub"

    @classmethod
    def find(cls) -> "TritonInstallation":
        spec = importlib.util.find_spec("pytriton")  # locates the package without importing it
        if spec is None or not spec.submodule_search_locations:
            raise TritonNotInstalled(
                "nvidia-pytriton is not installed; `pip install nvidia-pytriton==0.7.0` "
                "(or pass --triton-url to use an external Triton)"
            )
        package = Path(next(iter(spec.submodule_search_locations)))
        install = cls(root=package / "tritonserver", libs=package.parent / "nvidia_pytriton.libs")
        for path in (install.binary, install.python_backend / "libtriton_python.so", install.stub, install.libs):
            if not path.exists():
                raise TritonNotInstalled(f"the nvidia-pytriton wheel lacks {path}")
        return install

    def prepare_backends(self, workdir: Path) -> Path:
        """Build ``workdir/backends/python`` with the backend library and this interpreter's stub."""
        backends = workdir / "backends"
        python = backends / "python"
        python.mkdir(parents=True, exist_ok=True)
        for item in self.python_backend.iterdir():
            target = python / item.name
            if not target.exists():
                target.symlink_to(item)
        stub = python / "triton_python_backend_stub"
        if not stub.exists():
            # The stub is copied, not linked: Triton resolves it next to the backend library.
            shutil.copy2(self.stub, stub)
        return backends

    def environment(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """The environment tritonserver and its Python model processes need."""
        env = dict(os.environ if base is None else base)
        libdir = sysconfig.get_config_var("LIBDIR") or ""
        parts = [p for p in (libdir, str(self.libs), env.get("LD_LIBRARY_PATH", "")) if p]
        env["LD_LIBRARY_PATH"] = os.pathsep.join(parts)
        bindir = str(Path(sys.executable).parent)
        env["PATH"] = os.pathsep.join([bindir, env.get("PATH", "/usr/bin:/bin")])
        # Model processes: one thread each for the math libraries unless the operator says otherwise.
        env.setdefault("OMP_NUM_THREADS", "1")
        # The LLM adapter's vLLM engine runs from its own environment (numpy 2): `make setup` builds it
        # beside this one; INFERPLANE_VLLM_PYTHON (passed through) names another.
        vllm_python = default_vllm_python()
        if vllm_python is not None:
            env.setdefault(VLLM_PYTHON_ENV, str(vllm_python))
        return env


VLLM_PYTHON_ENV = "INFERPLANE_VLLM_PYTHON"


def default_vllm_python() -> Path | None:
    """``.venv-vllm/bin/python`` beside this interpreter's environment, where `make setup` put it."""
    candidate = Path(sys.prefix).parent / ".venv-vllm" / "bin" / "python"
    return candidate if candidate.is_file() else None
