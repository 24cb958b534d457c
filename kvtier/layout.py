"""KVLayout: the shape of one KV page, per-layer sliding windows, and the footprint arithmetic of seed 000."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.errors import ConfigError
from kvtier.quant import SCALE_ROWS

SUPPORTED_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
PAGE_ONLY_DTYPES = {"int8": torch.int8}  # a kv_dtype only: int8 pages (kvtier/quant.py), never a model's dtype
KV_DTYPE_ALIASES = {"fp8_e4m3": "float8_e4m3fn"}  # the recipe's short name for FP8 E4M3 pages


def resolve_dtype(dtype: str | torch.dtype, field: str = "dtype") -> torch.dtype:
    """Map a dtype name (or a torch dtype) to a supported torch dtype, or raise ConfigError; ``field="kv_dtype"``
    also takes :data:`PAGE_ONLY_DTYPES`."""
    supported = {**SUPPORTED_DTYPES, **PAGE_ONLY_DTYPES} if field == "kv_dtype" else SUPPORTED_DTYPES
    if isinstance(dtype, torch.dtype):
        if dtype in supported.values():
            return dtype
        dtype = str(dtype).removeprefix("torch.")
    if dtype not in supported:
        raise ConfigError(field, f"unsupported dtype {dtype!r}; use one of {sorted(supported)}")
    return supported[dtype]


def _positive(field: str, value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(field, f"must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class KVLayout:
    """Shape of the paged KV cache: one page holds K and V for ``page_size`` tokens of one layer.

    A page is ``[2, page_size, num_kv_heads, head_dim]`` (FlashInfer NHD); a tier's pool for one
    layer is ``[slots, 2, page_size, num_kv_heads, head_dim]``.

    ``dtype`` is the model's (what K/V arrive in and attention returns); ``kv_dtype`` is what pages store (default:
    ``dtype``; ``"fp8_e4m3"`` or ``"int8"``: 8-bit pages with ``R`` rows of scales, ``[2, page_size + R, N_kv, D]``,
    :mod:`kvtier.quant`).

    ``sliding_windows``: empty (every layer global) or one entry per layer, the number of keys a
    query of that layer sees (itself included, HF's ``sliding_window``), 0 for a global layer.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int = 16
    dtype: torch.dtype | str = torch.bfloat16
    sliding_windows: tuple[int, ...] = ()
    kv_dtype: torch.dtype | str | None = None

    def __post_init__(self):
        _positive("num_layers", self.num_layers)
        _positive("num_kv_heads", self.num_kv_heads)
        _positive("head_dim", self.head_dim)
        _positive("page_size", self.page_size)
        if self.page_size & (self.page_size - 1):
            raise ConfigError("page_size", f"must be a power of two, got {self.page_size}")
        object.__setattr__(self, "dtype", resolve_dtype(self.dtype))
        kv_dtype = self.dtype if self.kv_dtype is None else KV_DTYPE_ALIASES.get(self.kv_dtype, self.kv_dtype)
        object.__setattr__(self, "kv_dtype", resolve_dtype(kv_dtype, "kv_dtype"))
        if self.scaled and self.head_dim % 4:
            raise ConfigError("kv_dtype", f"8-bit pages keep each head's scales in their scale rows: head_dim must be "
                                          f"a multiple of 4, got {self.head_dim}")
        windows = tuple(self.sliding_windows or ())
        if windows and len(windows) != self.num_layers:
            raise ConfigError("sliding_windows", f"needs one entry per layer ({self.num_layers}), got {len(windows)}")
        for w in windows:
            if not isinstance(w, int) or isinstance(w, bool) or w < 0:
                raise ConfigError("sliding_windows", f"entries must be integers >= 0 (0: global layer), got {w!r}")
        object.__setattr__(self, "sliding_windows", windows if any(windows) else ())

    def window(self, layer: int) -> int:
        """Keys a query of ``layer`` sees (itself included), or 0 for a global layer."""
        return self.sliding_windows[layer] if self.sliding_windows else 0

    @property
    def scaled(self) -> bool:
        """Pages hold quantized values plus rows of scales (``kv_dtype`` FP8 or int8)."""
        return self.kv_dtype in SCALE_ROWS

    @property
    def scale_rows(self) -> int:
        """Rows of scales after the values in each half of a page (0 for pages stored as they are)."""
        return SCALE_ROWS.get(self.kv_dtype, 0)

    @property
    def page_shape(self) -> tuple[int, int, int, int]:
        """Stored page: ``(2, page_size + scale_rows, num_kv_heads, head_dim)``."""
        return (2, self.page_size + self.scale_rows, self.num_kv_heads, self.head_dim)

    @property
    def dtype_bytes(self) -> int:
        """Bytes per stored K/V element (``kv_dtype``)."""
        return self.kv_dtype.itemsize

    @property
    def page_bytes(self) -> int:
        """Bytes of one stored page of one layer (K and V, and the scale rows of 8-bit pages)."""
        return 2 * (self.page_size + self.scale_rows) * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def token_bytes(self) -> int:
        """Bytes of K and V for one token over all layers: 2·L·N_kv·D·P_bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def pages_for(self, tokens: int) -> int:
        """Pages needed to hold ``tokens`` tokens of one sequence (per layer)."""
        return -(-tokens // self.page_size)


def kv_tokens(num_layers: int, seq_len: int, windows: Sequence[int] | None = None) -> int:
    """Tokens of K/V one sequence keeps, summed over layers: ``L·S``, a sliding layer capped at its window."""
    windows = windows or [0] * num_layers
    if len(windows) != num_layers:
        raise ConfigError("sliding_windows", f"needs one entry per layer ({num_layers}), got {len(windows)}")
    return sum(min(seq_len, w) if w else seq_len for w in windows)


def kv_footprint_bytes(
    num_layers: int, num_kv_heads: int, head_dim: int, bytes_per_elem: float, seq_len: int, batch: int,
    windows: Sequence[int] | None = None,
) -> float:
    """Seed 000's M_KV = 2·L·N_kv·D·P_bytes·S·B, in bytes (P_bytes may be 0.5 for FP4).

    With per-layer ``windows`` (0: global) a sliding layer holds at most its window: ``L·S`` becomes
    :func:`kv_tokens`.
    """
    return 2 * num_kv_heads * head_dim * bytes_per_elem * kv_tokens(num_layers, seq_len, windows) * batch


def decode_arithmetic_intensity(
    num_params: float, num_layers: int, num_kv_heads: int, head_dim: int, bytes_per_elem: float, seq_len: int,
    batch: int = 1, windows: Sequence[int] | None = None,
) -> float:
    """Seed 000's I_decode (FLOPs per byte) for one decode step:

    (2·P + 4·L·N_kv·D·S) / (P·P_bytes + 2·L·N_kv·D·S·P_bytes) at ``batch=1``, which is 2/P_bytes
    for every S. For B sequences FLOPs and KV bytes scale by B while the weights are read once:
    batching raises it, a long context pulls it back towards 2/P_bytes. Sliding layers (``windows``)
    read at most their window.
    """
    kv_elems = num_kv_heads * head_dim * kv_tokens(num_layers, seq_len, windows) * batch
    flops = 2 * num_params * batch + 4 * kv_elems
    bytes_moved = num_params * bytes_per_elem + 2 * kv_elems * bytes_per_elem
    return flops / bytes_moved


def footprint_table(
    num_layers: int = 80, num_kv_heads: int = 8, head_dim: int = 128,
    rows: tuple[tuple[int, int, float], ...] = ((8192, 1, 2), (32768, 4, 2), (131072, 8, 2), (1048576, 16, 1)),
) -> list[dict]:
    """Seed 000's footprint table (defaults: the 70B config, L=80, N_kv=8, D=128).

    Each row gives bytes, GiB and TiB. The seed prints 2.56 / 40.96 / 327.68 GiB and 2.56 TiB:
    those are these exact binary values (2.5 / 40 / 320 GiB, 2.5 TiB) times 1.024, i.e. MiB (or
    GiB) divided by 1000; ``seed_printed`` reproduces the printed figure in the row's own unit.
    """
    out = []
    for seq_len, batch, nbytes in rows:
        total = kv_footprint_bytes(num_layers, num_kv_heads, head_dim, nbytes, seq_len, batch)
        out.append({
            "seq_len": seq_len, "batch": batch, "bytes_per_elem": nbytes, "bytes": total,
            "GiB": total / 2**30, "TiB": total / 2**40,
            "seed_printed": total / 2**30 * 1.024 if total < 2**40 else total / 2**40 * 1.024,
        })
    return out
