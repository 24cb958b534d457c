"""StepCosts: the time of one engine iteration on one GPU (or a tensor-parallel group), operator by operator.

Each operator's hardware time is its roofline, ``max(bytes / HBM rate, FLOPs / peak)`` at the rates measured on
the calibration's GPU kind (:class:`~kvtier.sim.calibration.Calibration`); FP8 weights multiply at the FP8 peak
(the datasheet's FP8 / bf16 ratio times the measured bf16 rate). Per GPU of a group of ``tp``:

- linear layers: the weights once (``decode_params`` x weight bytes) against 2 FLOPs per weight per token
  (a decode row multiplies the output head too, a prompt token does not);
- attention: a decode row reads its keys' KV (memory-bound); a prompt chunk's causal attention is FLOPs over
  its prefix and itself;
- all-reduce: two per layer of the iteration's activations (tokens x hidden, bf16), ring over NVLink
  (:func:`~kvtier.sim.hardware.allreduce_s` on the calibration's alpha-beta line: ``bench.collectives``'
  measured latency and bus rate, or where it has not run the assumed latency at the NCCL send rate).

``engine=True`` adds what kvtier's engine costs beyond that, from the calibration's fitted parameters: the
bound operator of each layer times its multiplier (weights read, matmul, KV read, prefill attention), the FP8
page kernel's measured slowdown, fixed costs per layer, per row and per chunk, and the serve scheduler's per
iteration. ``engine=False`` is the hardware roofline alone. Every formula is affine in each fitted parameter
(:func:`kvtier.sim.calibrate.fit` reads its design matrix off them). Times are ms.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.sim.calibration import Calibration
from kvtier.sim.hardware import GPUS, Link, ModelShape, allreduce_s


@dataclass
class StepCosts:
    cal: Calibration
    model: ModelShape
    tp: int = 1  # tensor-parallel GPUs per instance: weights, kv heads and FLOPs split tp ways
    kv_bytes: float = 2.0  # per KV element: 2 (bf16), 1 (FP8 pages)
    weight_bytes: float = 2.0  # per weight: 2 (bf16), 1 (FP8, multiplied at the FP8 peak)
    engine: bool = True  # False: the hardware roofline alone
    allreduce_latency_us: float | None = None  # None: the calibration's (measured, or its named assumption)

    def __post_init__(self):
        m, tp, cal = self.model, self.tp, self.cal
        self.gpu_sheet = sheet = GPUS[cal.gpu]
        self.hbm = cal.hbm_GBps * 1e6  # bytes per ms
        self.bf16 = cal.bf16_tflops * 1e9  # FLOP per ms
        self.peak_w = self.bf16 * (sheet.fp8_tflops / sheet.bf16_tflops if self.weight_bytes == 1 else 1.0)
        self.weights_mem = m.decode_params * self.weight_bytes / tp / self.hbm  # ms to read the weights once
        self.row_flop_ms = 2 * m.decode_params / tp / self.peak_w  # ms of matmul per decode row
        self.token_flop_ms = 2 * m.matmul_params / tp / self.peak_w  # per prompt token
        kv_read = self.token_bytes() / self.hbm  # ms to read one key's KV
        kv_flops = 4 * m.layers * m.q_heads * m.head_dim / tp / self.bf16
        self.key_ms = max(kv_read, kv_flops)
        if self.allreduce_latency_us is None:
            self.allreduce_latency_us = cal.allreduce["latency_us"]
        self.nvlink = Link("nvlink all-reduce", cal.allreduce["bus_GBps"], self.allreduce_latency_us)
        p = {k: v for group in cal.params.values() for k, v in group.items()} if self.engine else {}
        self.x = {k: p.get(k, 1.0) for k in ("weights_x", "matmul_x", "kv_x", "attn_x", "miss_x")}
        self.x["kv_x"] *= cal.fp8_kv_x if self.engine and self.kv_bytes == 1 else 1.0
        self.us = {k: p.get(k, 0.0) for k in ("layer_us", "row_us", "chunk_layer_us", "choice_us", "choice_row_us")}
        self.ms = {k: p.get(k, 0.0) for k in ("tiered_ms", "step_ms")}

    def token_bytes(self) -> float:
        """KV bytes of one token on one GPU of the group (all layers)."""
        return self.model.kv_token_bytes(self.kv_bytes) / self.tp

    def linear_ms(self, rows: int, prompt_tokens: int) -> float:
        """The weight matmuls of ``rows`` decode rows and ``prompt_tokens`` prompt tokens: bound by the weights'
        bytes or by the FLOPs, each times kvtier's multiplier for that bound."""
        flops = self.row_flop_ms * rows + self.token_flop_ms * prompt_tokens
        return self.x["weights_x"] * self.weights_mem if self.weights_mem >= flops else self.x["matmul_x"] * flops

    def decode_attention_ms(self, keys: float) -> float:
        """Decode attention of rows attending ``keys`` keys in all (every layer)."""
        return self.x["kv_x"] * self.key_ms * keys

    def prefill_attention_ms(self, parts) -> float:
        """Causal attention of prompt chunks ``[(tokens, prefix)]`` (every layer)."""
        flops = sum(self.model.attention_flops(n, start) for n, start in parts) / self.tp / self.bf16
        read = sum(start + n for n, start in parts) * self.token_bytes() / self.hbm
        return self.x["attn_x"] * max(flops, read)

    def allreduce_ms(self, tokens: int) -> float:
        """The iteration's two all-reduces per layer of ``tokens`` tokens' activations (bf16)."""
        return 2 * self.model.layers * allreduce_s(tokens * self.model.hidden * 2.0, self.tp, self.nvlink) * 1e3

    def iteration_ms(self, rows: int, keys: float, parts=(), serve: bool = True) -> float:
        """One forward of ``rows`` decode rows attending ``keys`` keys in all and prompt chunks ``[(tokens,
        prefix)]``; ``serve``: run by the serve scheduler (its per-iteration cost)."""
        prompt = sum(n for n, _ in parts)
        if not rows and not prompt:
            return 0.0
        L, us = self.model.layers, self.us
        t = self.linear_ms(rows, prompt) + self.allreduce_ms(rows + prompt)
        t += self.decode_attention_ms(keys) if rows else 0.0
        t += self.prefill_attention_ms(parts) if prompt else 0.0
        t += L * (us["layer_us"] + us["row_us"] * rows + us["chunk_layer_us"] * len(parts)) * 1e-3
        return t + (self.ms["step_ms"] if serve else 0.0)

    def decode_ms(self, rows: int, keys: float, serve: bool = True) -> float:
        return self.iteration_ms(rows, keys, (), serve)

    def prompt_ms(self, prompt: int, cached: int, chunk: int) -> float:
        """A whole prompt's prefill alone, its uncached part cut into ``chunk``-token iterations (a fully cached
        prompt still prefills its last token)."""
        start, t = min(cached, prompt - 1), 0.0
        while start < prompt:
            n = min(chunk, prompt - start)
            t, start = t + self.iteration_ms(0, 0.0, [(n, start)]), start + n
        return t

    def host_ms(self, MB: float) -> float:
        """``MB`` over the pinned host link at its measured rate (1 MB / (GB/s) = 1 ms)."""
        return MB / self.cal.host_GBps

    def resident_ms(self, rows: int, keys: float, moved_MB: float) -> float:
        """A decode step over the ``keys`` its device pages hold (scope ``resident``), the host planning the
        pages that moved and ``moved_MB`` crossing the host link."""
        return self.decode_ms(rows, keys, serve=False) + self.ms["tiered_ms"] + self.host_ms(moved_MB)

    def recall_ms(self, rows: int, keys: float, moved_MB: float) -> float:
        """A ``topk`` decode step attending ``keys`` keys, its per-layer page choice and ``moved_MB`` of misses
        read from host memory."""
        L, us = self.model.layers, self.us
        choice = L * (us["choice_us"] + us["choice_row_us"] * rows) * 1e-3
        return self.decode_ms(rows, keys, serve=False) + choice + self.x["miss_x"] * self.host_ms(moved_MB)
