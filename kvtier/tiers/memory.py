"""Tiers whose pages are addressable tensors: the device (HBM) and pinned host DRAM."""

from __future__ import annotations

import torch

from kvtier.errors import ConfigError
from kvtier.layout import KVLayout
from kvtier.tiers.base import Tier


class MemoryTier(Tier):
    """A tier backed by one tensor ``[L, capacity, 2, P, N_kv, D]`` on ``device``."""

    def __init__(self, layout: KVLayout, capacity: int, device: torch.device,
                 pin_memory: bool = False, name: str | None = None):
        super().__init__(layout, capacity, name)
        shape = (layout.num_layers, capacity, *layout.page_shape)
        self._device = torch.device(device)
        # zeros: attention multiplies a page's unwritten rows by probability 0, and fresh memory may hold NaN
        self._pool = torch.zeros(shape, dtype=layout.kv_dtype, device=self._device, pin_memory=pin_memory)

    @property
    def device(self) -> torch.device:
        return self._device

    def pool(self, layer: int) -> torch.Tensor:
        return self._pool[layer]  # [cap, 2, P, N_kv, D]

    def pools(self) -> torch.Tensor:
        return self._pool.view(-1, *self.layout.page_shape)  # [L * cap, 2, P, N_kv, D]

    def read(self, layer, slots, out=None):
        idx = slots.to(self._device, non_blocking=True)
        if out is None:
            return self._pool[layer].index_select(0, idx)  # [n, 2, P, N_kv, D]
        torch.index_select(self._pool[layer], 0, idx, out=out)
        return out

    def write(self, layer, slots, pages):
        self._check_pages(slots, pages)
        # as bytes: torch has no CPU index_copy_ for float8
        self._pool[layer].view(torch.uint8).index_copy_(0, slots.to(self._device, non_blocking=True),
                                                        pages.to(self._device, non_blocking=True).view(torch.uint8))


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


class DeviceTier(MemoryTier):
    """Tier 1: HBM on a GPU; on a CPU-only machine, plain memory with the same page budget."""

    kind = "device"

    def __init__(self, layout: KVLayout, capacity: int, device: str | torch.device | None = None,
                 name: str | None = None):
        super().__init__(layout, capacity, present_device(device, name or self.kind), name=name)


def present_device(device, tier: str) -> torch.device:
    """``device`` (None: :func:`default_device`) as a torch device this machine has; ConfigError("device") if not."""
    if device is None:
        return default_device()
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError("device", f"tier '{tier}': {device!r} is not a torch device ({e}); use cuda, cuda:N or "
                                    "cpu (None: the GPU when there is one)") from None
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ConfigError("device", f"tier '{tier}': {device} is not here ({torch.cuda.device_count()} GPUs "
                                    "visible); use cpu, or None: the GPU when there is one")
    return device


class HostTier(MemoryTier):
    """Tier 2: host DRAM (the seed's CXL stand-in), pinned when CUDA is present."""

    kind = "host"

    def __init__(self, layout: KVLayout, capacity: int, pin_memory: bool | None = None, name: str | None = None):
        if pin_memory is not None and not isinstance(pin_memory, bool):
            raise ConfigError("pin_memory", f"tier '{name or self.kind}': must be True, False or None (pinned where "
                                            f"CUDA is), got {pin_memory!r}")
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        super().__init__(layout, capacity, torch.device("cpu"), pin_memory=pin, name=name)
