"""Backend names -> AttentionBackend instances (the ``kernel`` config knob)."""

from __future__ import annotations

import os

import torch

from kvtier.errors import ConfigError
from kvtier.kernels.base import AttentionBackend
from kvtier.kernels.flashinfer import FlashInferBackend
from kvtier.kernels.reference import TorchBackend

BACKENDS = ("auto", "torch", "triton", "flashinfer")


def backend_for(kernel, device) -> AttentionBackend:
    """``kernel=`` of every door (the recipes' key): a backend as given, a name of :data:`BACKENDS` made for
    ``device`` (where the model runs), or None: ``auto``."""
    if kernel is None or isinstance(kernel, str):
        return make_backend(kernel or "auto", device)
    return kernel


def make_backend(name: str, device: str = "cuda") -> AttentionBackend:
    """A fresh backend: ``torch`` (reference, any device), or on ``device`` (the model's) ``triton`` (a
    GPU, or the CPU under TRITON_INTERPRET=1) or ``flashinfer`` (a GPU and ``pip install 'kvtier[gpu]'``);
    ``auto``: ``triton`` on a GPU, else ``torch``."""
    if name == "auto":
        name = "triton" if torch.device(device).type == "cuda" and torch.cuda.is_available() else "torch"
    if name == "torch":
        return TorchBackend()
    if name not in BACKENDS:
        raise ConfigError("kernel", f"unknown kernel backend {name!r}; use one of {', '.join(BACKENDS)}")
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        if name == "flashinfer" or os.environ.get("TRITON_INTERPRET") != "1":
            raise ConfigError("kernel", f"kernel={name} needs a GPU (triton runs on a CPU only under "
                                        "TRITON_INTERPRET=1, slowly); use kernel=torch")
    if name == "flashinfer":
        return FlashInferBackend(device=device)
    # Imported here: triton.jit picks compiled or interpreted kernels (TRITON_INTERPRET) at import.
    from kvtier.kernels.triton_decode import TritonBackend

    return TritonBackend()
