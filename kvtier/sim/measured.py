"""kvtier's bench JSONs as cases the simulator can predict: one :class:`Measured` per timed row.

Each case names its configuration (``kind`` and ``case``) and the time measured for it (``ms``). The cases
replay what the run itself recorded where the time depends on it (a ``topk`` row's hit rate and bytes moved
per step): the simulator predicts the time of a configuration given those statistics.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.errors import ConfigError

BENCH_FILES = {"e2e": "e2e-s5.json", "kernels": "kernels-s5.json", "transfers": "transfers.json",
               "serve": "serve-s5.json", "goodput": "serve-goodput-s5.json", "disagg": "disagg.json",
               "redis": "redis_tier.json"}


@dataclass(frozen=True)
class Measured:
    """One timed bench row: ``kind`` (decode | prefill | mixed | disagg), its configuration, ``ms`` measured."""

    id: str
    kind: str
    ms: float
    case: dict = field(default_factory=dict, hash=False)


def read_bench(folder: str | Path) -> dict:
    """The bench JSONs of :data:`BENCH_FILES` in ``folder``, by key; a missing or unreadable file is a ConfigError."""
    folder, out = Path(folder), {}
    for key, name in BENCH_FILES.items():
        path = folder / name
        try:
            out[key] = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"bench.{key}", f"{path} not found; run the bench that writes it (bench/RESULTS.md) "
                                              "or point --bench at the folder holding it") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"bench.{key}", f"{path} is not JSON ({e})") from None
    return out


def decode_rows(e2e: dict) -> list[Measured]:
    """The kvtier rows of ``bench/e2e.py`` (fast path; TPOT p50 per step)."""
    out = []
    for r in e2e["rows"]:
        if r["system"] != "kvtier":
            continue
        rid = f"e2e {r['model']} {r['B']}x{r['S']} {r['scope']} {r['budget']:g} k{r['lookahead']}"
        out.append(Measured(rid, "decode", r["tpot_p50_ms"], {
            "model": r["model"], "batch": r["B"], "context": r["S"], "scope": r["scope"], "budget": r["budget"],
            "hit_rate": r["hit_rate"], "moved_MB": r["MB_moved_per_step"]}))
    return out


def serve_rows(serve: dict, goodput: dict) -> list[Measured]:
    """``bench/serve.py``: cold and radix-hit TTFT, decode ITL p50 alone and beside prefill chunks, and one
    session alone (its prompt in chunks of the goodput part's token budget)."""
    sz, out = serve["sizes"], []
    for r in serve["rows"]:
        part, system = r["part"], r["system"]
        if system in ("cold", "radix hit"):
            out.append(Measured(f"serve {part} {system}", "prefill", r["ttft_ms"], {
                "model": "llama8b-shape", "prompt": sz["long"], "cached": r["cached_tokens"], "chunk": sz["long"]}))
        elif system == "decode only" or system.startswith("decode +"):
            chunk = 0 if system == "decode only" else int(system.split("+ ")[1].split("-")[0])
            out.append(Measured(f"serve {part} {system} (p50)", "mixed", r["itl_p50_ms"], {
                "model": "llama8b-shape", "batch": sz["batch"], "context": sz["ctx"], "chunk": chunk,
                "prompt": sz["long"]}))
    alone = next(r for r in goodput["rows"] if r["system"].startswith("1 session alone"))
    gz = goodput["sizes"]
    out.append(Measured("serve goodput: 1 session alone, TTFT", "prefill", alone["ttft_ms"], {
        "model": "llama8b-shape", "prompt": gz["long"], "cached": 0, "chunk": gz["budget"]}))
    return out


def disagg_rows(disagg: dict) -> list[Measured]:
    """``bench/disagg.py`` on 2 GPUs: the prefill alone and the TTFT at the decode rank."""
    a, p = disagg["args"], disagg["prefill"]
    case = {"model": "llama8b-shape", "prompt": a["tokens"], "cached": 0, "chunk": a["chunk"]}
    return [Measured("disagg prefill alone", "prefill", p["prefill_alone_ms"], case),
            Measured("disagg TTFT (decode rank)", "disagg", disagg["decode"]["ttft_ms"],
                     {**case, "layer_bytes": p["layer_bytes"]})]


def measured_rows(bench: dict) -> list[Measured]:
    """Every timed row the simulator is validated on."""
    return decode_rows(bench["e2e"]) + serve_rows(bench["serve"], bench["goodput"]) + disagg_rows(bench["disagg"])
