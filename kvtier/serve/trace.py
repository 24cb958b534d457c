"""Request traces: the Mooncake FAST'25 traces (Qin et al., "Mooncake: Trading More Storage for Less
Computation", USENIX FAST'25), time-scaled, with token ids derived from their 512-token block hashes.

A record is ``{"timestamp" (ms), "input_length", "output_length", "hash_ids"}``; ``hash_ids[i]`` names the
prefix up to block ``i`` (equal ids = reusable KV). Token ``j`` of block ``h`` is ``splitmix64(h * 512 + j)
mod vocab``, so equal blocks have equal tokens and distinct blocks (almost surely) differ from their
first page on; a request's last block is usually partial (``len(hash_ids) == ceil(input_length / 512)``).
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvtier.errors import ConfigError
from kvtier.radix import RadixCache, splitmix64

BLOCK = 512  # tokens per hash block in the Mooncake traces
TRACES = ("conversation", "synthetic")


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float  # after time scaling, from the trace's start
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def traces_dir() -> Path:
    """``$KVTIER_TRACES``, else the copies shipped with kvtier (``kvtier/traces``, gzipped; Apache-2.0,
    attribution in their README)."""
    env = os.environ.get("KVTIER_TRACES")
    return Path(env) if env else Path(__file__).resolve().parents[1] / "traces"


def load_trace(name: str, time_scale: float = 1.0, start: int = 0, limit: int | None = None) -> list[TraceRequest]:
    """Requests ``start .. start + limit`` of trace ``name`` (``conversation``, ``synthetic`` or a .jsonl
    path); arrival times are divided by ``time_scale`` (2.0: twice the request rate) and start at 0."""
    path = Path(name) if name.endswith(".jsonl") else traces_dir() / f"{name}_trace.jsonl"
    if not path.is_file() and path.with_suffix(".jsonl.gz").is_file():
        path = path.with_suffix(".jsonl.gz")
    if not name.endswith(".jsonl") and name not in TRACES:
        raise ConfigError("task.trace", f"unknown trace {name!r}; use one of {list(TRACES)} or a .jsonl path")
    if not path.is_file():
        raise ConfigError("task.trace", f"{path} not found; set KVTIER_TRACES to the folder holding the traces")
    if not time_scale > 0:
        raise ConfigError("task.time_scale", f"must be > 0, got {time_scale!r}")
    out, i = [], -1
    try:
        with (gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")) as f:
            for i, line in enumerate(f):
                if i < start:
                    continue
                if limit is not None and len(out) >= limit:
                    break
                out.append(_request(json.loads(line)))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError
        where = path if isinstance(e, (OSError, UnicodeDecodeError)) else f"{path} line {i + 1}"  # decoded in blocks
        raise ConfigError("task.trace", f"{where}: {type(e).__name__}: {e}; a trace is UTF-8 JSON lines, each an "
                                        "object with timestamp (ms), input_length, output_length and hash_ids") from None
    if not out:
        raise ConfigError("task.start" if i >= 0 else "task.trace",
                          f"{path} holds {i + 1} requests: none from start={start} on" if i >= 0 else f"{path} is empty")
    t0 = out[0].arrival_s if out else 0.0
    return [TraceRequest((r.arrival_s - t0) / time_scale, r.input_length, r.output_length, r.hash_ids) for r in out]


def _request(r: dict) -> TraceRequest:
    """One trace line's request (times in ms in the file)."""
    return TraceRequest(r["timestamp"] / 1000.0, int(r["input_length"]), int(r["output_length"]),
                        tuple(int(h) for h in r["hash_ids"]))


def prompt_tokens(req: TraceRequest, vocab: int) -> np.ndarray:
    """The request's prompt ``[input_length]`` int64: block ``i`` is a function of ``hash_ids[i]`` alone."""
    h = np.asarray(req.hash_ids, dtype=np.uint64)[:, None] * np.uint64(BLOCK)  # [n, 1]
    ids = splitmix64((h + np.arange(BLOCK, dtype=np.uint64)).ravel()[:req.input_length])  # [S]
    return (ids % np.uint64(vocab)).astype(np.int64)


@dataclass
class HitRatio:
    blocks: float  # per 512-token block, the share of its tokens served from the cache; mean over blocks
    tokens: float  # prompt tokens served from the cache / prompt tokens


def unbounded_hit_ratio(trace: list[TraceRequest], page_size: int, vocab: int = 49152) -> HitRatio:
    """Replay ``trace`` in order through a radix index with no capacity limit: each request matches its
    longest cached page-aligned prefix, then is inserted. A full block is a hit or a miss; a partial last
    block counts the share of its tokens matched (its page-aligned part)."""
    if BLOCK % page_size:
        raise ConfigError("page_size", f"must divide the traces' block of {BLOCK} tokens, got {page_size}")
    index = RadixCache(None, page_size=page_size)
    blocks = hit_blocks = hit_tokens = tokens = 0
    next_id = 0
    for req in trace:
        ids = prompt_tokens(req, vocab)
        m = index.match(ids)
        S, n = req.input_length, len(req.hash_ids)
        block_len = np.minimum(BLOCK, S - BLOCK * np.arange(n))  # [n]
        matched = np.clip(m.n_tokens - BLOCK * np.arange(n), 0, block_len)  # [n]
        hit_blocks += float((matched / block_len).sum())
        blocks, hit_tokens, tokens = blocks + n, hit_tokens + m.n_tokens, tokens + S
        pages = S // page_size
        index.insert(ids, np.arange(next_id, next_id + pages), after=m)
        next_id += pages
    return HitRatio(hit_blocks / blocks, hit_tokens / tokens)
