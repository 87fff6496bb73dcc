"""inferplane: the frontend and control plane in front of Triton Inference Server."""

__version__ = "0.1.0"
