"""Backend names -> AttentionBackend instances (the ``kernel`` config knob)."""

from __future__ import annotations

from kvtier.errors import ConfigError
from kvtier.kernels.base import AttentionBackend
from kvtier.kernels.flashinfer import FlashInferBackend
from kvtier.kernels.reference import TorchBackend

BACKENDS = ("torch", "triton", "flashinfer")


def make_backend(name: str) -> AttentionBackend:
    """A fresh backend: ``torch`` (reference), ``triton`` or ``flashinfer`` (needs kvtier[gpu])."""
    if name == "torch":
        return TorchBackend()
    if name == "triton":
        # Imported here: triton.jit picks compiled or interpreted kernels (TRITON_INTERPRET) at import.
        from kvtier.kernels.triton_decode import TritonBackend

        return TritonBackend()
    if name == "flashinfer":
        return FlashInferBackend()
    raise ConfigError("kernel", f"unknown kernel backend {name!r}; use one of {', '.join(BACKENDS)}")
