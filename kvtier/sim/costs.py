"""StepCosts: the time of one engine step on one GPU (or a TP group), from a :class:`Calibration`.

Every formula is linear in the calibration's fitted parameters (:attr:`Calibration.params`), which is how
:func:`kvtier.sim.calibrate.fit_group` fits them on measured rows with these same functions. Times are ms.

- decode step = L·layer_ms + weights_x·(weights / HBM rate) + row_layer_ms·rows·L + L·attention(rows, keys)
  [+ plan_ms + plan_us_per_page·pages off the device, when some are]
  [+ L·recall layer_ms + misses read in place over the host link] [+ the serve scheduler's step_ms]
- prefill chunk = chunk_ms + flops_x·((2·params·n + attention FLOPs) / peak)
- attention per layer = the decode kernel's fixed ms + KV bytes / its rate (bench/kernels-s5.json)
Bandwidth and FLOP terms scale from the calibrated GPU to ``gpu`` by their datasheet ratio; fixed (launch,
host) costs do not.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.sim.calibration import Calibration
from kvtier.sim.hardware import GPUS, Gpu, ModelShape


@dataclass
class StepCosts:
    cal: Calibration
    model: ModelShape
    gpu: Gpu
    tp: int = 1  # tensor-parallel GPUs per instance: weights, kv heads and FLOPs split tp ways
    kv_bytes: float = 2.0  # per KV element: 2 (bf16), 1 (FP8 pages)
    allreduce_us: float = 0.0  # per all-reduce (2 per layer) when tp > 1: an assumption, kvtier measures none
    weight_bytes: float = 2.0  # per parameter: 2 (bf16), 1 (FP8 weights)

    @property
    def hbm_GBps(self) -> float:
        return self.cal.hbm_GBps * self.gpu.hbm_GBps / GPUS[self.cal.gpu].hbm_GBps

    @property
    def tflops(self) -> float:
        return self.cal.bf16_tflops * self.gpu.bf16_tflops / GPUS[self.cal.gpu].bf16_tflops

    def token_bytes(self) -> float:
        """KV bytes of one token on one GPU of the group (all layers)."""
        return self.model.kv_token_bytes(self.kv_bytes) / self.tp

    def attention_ms(self, rows: int, keys: float) -> float:
        """One layer's decode attention for ``rows`` sequences reading ``keys`` keys in all."""
        a = self.cal.attention["fp8" if self.kv_bytes == 1 else "bf16"]
        nbytes = keys * self.token_bytes() / self.model.layers
        rate = a["GBps"] * self.hbm_GBps / self.cal.hbm_GBps
        return a["ms"] + nbytes / (rate * 1e6) if rows else 0.0

    def _allreduce_ms(self) -> float:
        return 2 * self.model.layers * self.allreduce_us * 1e-3 if self.tp > 1 else 0.0

    def decode_ms(self, rows: int, keys: float, *, tiered: bool = False, off_pages: float = 0.0,
                  miss_MB: float = 0.0, recall: bool = False, serve: bool = False) -> float:
        """One decode step of ``rows`` sequences attending ``keys`` keys in all; ``tiered``: ``off_pages`` pages
        live off the device (the host plans over them); ``recall``: a topk scope reading ``miss_MB`` per step in
        place from host memory; ``serve``: run by the serve scheduler."""
        p, L = self.cal.params, self.model.layers
        d = p["decode"]
        weights_ms = self.model.params * self.weight_bytes / self.tp / (self.hbm_GBps * 1e6)
        t = (L * d["layer_ms"] + d["weights_x"] * weights_ms + d["row_layer_ms"] * rows * L
             + L * self.attention_ms(rows, keys) + self._allreduce_ms())
        if tiered:
            plan = p["tiered"]["plan_ms"] + p["tiered"]["plan_us_per_page"] * off_pages / 1e3
            t += plan + miss_MB / self.cal.host_GBps
        if recall:
            streams = max(1, rows * self.model.kv_heads // self.tp)
            t += L * p["recall"]["layer_ms"] + miss_MB * p["recall"]["stream_ms_per_MB"] / streams
        if serve:
            t += p["serve"]["step_ms"]
        return t

    def chunk_ms(self, tokens: int, prefix: int) -> float:
        """One prefill chunk of ``tokens`` after ``prefix`` cached tokens."""
        return self.batch_chunk_ms([(tokens, prefix)])

    def batch_chunk_ms(self, parts: list[tuple[int, int]]) -> float:
        """One prefill iteration over several prompts' chunks, ``(tokens, prefix)`` each."""
        parts = [(n, start) for n, start in parts if n > 0]
        if not parts:
            return 0.0
        p, peak = self.cal.params["prefill"], self.tflops * 1e9  # FLOP per ms
        flops = sum(self.model.linear_flops(n) + self.model.attention_flops(n, start) for n, start in parts)
        return p["chunk_ms"] + p["flops_x"] * flops / self.tp / peak + self._allreduce_ms()

    def prompt_ms(self, prompt: int, cached: int, chunk: int) -> float:
        """A whole prompt's prefill, its uncached part cut into ``chunk``-token chunks (a fully cached prompt still
        prefills its last token)."""
        start, t = min(cached, prompt - 1), 0.0
        while start < prompt:
            n = min(chunk, prompt - start)
            t, start = t + self.chunk_ms(n, start), start + n
        return t
