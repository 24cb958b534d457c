"""What recall's choice costs per layer on a GPU, beside the attention it saves: one layer of a decode step.

Per shape (``B x S``, SmolLM2's heads by default: 9 query / 3 kv heads, D=64, pages of 16, bf16), each part
captured in a CUDA graph and replayed (``--reps`` replays between CUDA events, the median of ``--trials``):

- ``dense``: the decode kernel over every page (what a dense step attends);
- ``keys``: the key choice of ``--attend`` of the context (sketch rank D/4: score bins, then the threshold and the
  list; :mod:`kvtier.kernels.triton_key_choice`), then the decode kernel over the chosen key lists;
- ``key choice`` / ``key attention``: those two apart;
- ``quest``: Quest's page choice of the same share of pages and the decode over them, for comparison.

Keys and sketches are random (the cost does not depend on the values). Writes ``key_choice.json`` (under ``$OUT``).

    python -m bench.key_choice --shapes 1x8192,16x8192,1x32768
"""

from __future__ import annotations

import argparse

import torch

from bench.common import print_table, write_json
from kvtier.kernels.triton_decode import plan_static_decode, static_decode
from kvtier.kernels.triton_key_choice import KeyChoiceWork, key_choice
from kvtier.kernels.triton_page_choice import ChoiceWork, page_choice


def graph_ms(work, reps: int, trials: int) -> float:
    """Median over ``trials`` of the ms one ``work()`` takes, replayed from a CUDA graph ``reps`` times."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        work()  # compile and warm up
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            work()
    times = []
    for _ in range(trials):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / reps)
    return sorted(times)[len(times) // 2]


def layer_rows(B: int, S: int, heads: int, n_kv: int, D: int, P: int, attend: float, reps: int, trials: int) -> list:
    dev, bf16 = "cuda", torch.bfloat16
    M = S // P
    r = max(D // 2, 1)  # the scope's default rank (8 bits)
    g = torch.Generator(device=dev).manual_seed(0)
    pool = torch.randn(B * M + 1, 2, P, n_kv, D, device=dev, dtype=bf16, generator=g)  # [slots, 2, P, N_kv, D]
    table = torch.randperm(B * M, device=dev, generator=g).view(B, M).int()
    pids = torch.arange(B * M, device=dev).view(B, M).int()
    lens = torch.full((B,), S, dtype=torch.int32, device=dev)
    q = torch.randn(B, heads, D, device=dev, dtype=bf16, generator=g)
    query_map = torch.linalg.qr(torch.randn(n_kv, D, D, device=dev, generator=g)).Q[..., :r].contiguous() / 64
    sketch = torch.randint(-127, 128, (B * M, P, n_kv, r), device=dev, dtype=torch.int8, generator=g)
    tokens = int(attend * S)
    sinks, window = 4, 64
    n = (tokens - sinks - window) // P * P  # the budget's middle keys
    width = tokens
    spans = torch.tensor([[sinks, S - (tokens - sinks - n)]] * B, dtype=torch.int32, device=dev)
    keys = torch.empty(B, n_kv, width, dtype=torch.int32, device=dev)
    work = KeyChoiceWork.make(B, n_kv, M * P, dev)
    dense_plan = plan_static_decode(B, M, heads, n_kv, D, P, dev)
    key_plan = plan_static_decode(B, M, heads, n_kv, D, P, dev, max_listed=width, keys=True)
    k_pages = max(int(attend * M), 1)
    kmin = torch.randn(B * M, n_kv, D, device=dev, generator=g)
    kmax = kmin + torch.rand(B * M, n_kv, D, device=dev, generator=g)
    cand = torch.ones(B, M, dtype=torch.bool, device=dev)
    pages = torch.empty(B, k_pages, dtype=torch.int32, device=dev)
    cwork = ChoiceWork.make(B, M, dev)
    page_plan = plan_static_decode(B, M, heads, n_kv, D, P, dev, max_listed=k_pages)
    scale = D ** -0.5

    def choose():
        key_choice(q, query_map, sketch, pids, table, lens, spans, n, keys, work=work)

    def attend_keys():
        static_decode(q, pool, None, table, lens, key_plan, scale, key_list=keys)

    def quest():
        page_choice(q, kmin, kmax, pids, cand, k_pages, work=cwork, out=pages)
        static_decode(q, pool, None, table, lens, page_plan, scale, page_list=pages)

    choose()
    assert int((keys >= 0).sum()) == B * n_kv * min(width, S)  # the budget, every key
    parts = {"dense": lambda: static_decode(q, pool, None, table, lens, dense_plan, scale),
             "keys": lambda: (choose(), attend_keys()), "key choice": choose, "key attention": attend_keys,
             "quest": quest}
    kv_bytes = B * S * n_kv * D * 2 * 2
    rows = []
    for name, fn in parts.items():
        ms = graph_ms(fn, reps, trials)
        rows.append({"B": B, "S": S, "part": name, "ms": ms, "us": ms * 1e3, "attend": attend,
                     "sketch_rank": r, "kv_MB": kv_bytes / 1e6})
    dense = rows[0]["ms"]
    for row in rows:
        row["x_dense"] = row["ms"] / dense
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="1x8192,16x8192,1x32768")
    ap.add_argument("--heads", default="9/3", help="query / kv heads")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--attend", type=float, default=0.2)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--json", default="key_choice.json")
    args = ap.parse_args()
    heads, n_kv = (int(x) for x in args.heads.split("/"))
    rows = []
    for shape in args.shapes.split(","):
        B, S = (int(x) for x in shape.split("x"))
        rows += layer_rows(B, S, heads, n_kv, args.head_dim, args.page, args.attend, args.reps, args.trials)
        write_json(args.json, {"gpu": torch.cuda.get_device_name(), "args": vars(args), "rows": rows})
    print_table(f"one layer's decode on {torch.cuda.get_device_name()} ({args.heads} heads, D={args.head_dim}, "
                f"attend {args.attend})", rows, ["B", "S", "part", "us", "x_dense"])


if __name__ == "__main__":
    main()
