"""Serving iterations (fp32; on the CPU the torch reference kernels, on a GPU the Triton kernels and captured decode
steps): a forward that mixes decode rows and prompt chunks of several sequences gives the logits each would get
alone, and a radix hit of all but the prompt's last token runs as a decode row and gives a cold run's tokens."""

import numpy as np
import pytest
import torch

from kvtier.engine import Engine, EngineConfig
from kvtier.errors import KVTierError
from kvtier.kernels.registry import make_backend
from kvtier.kernels.triton_decode import TritonBackend
from kvtier.kernels.triton_prefill import PrefillConfig
from kvtier.models import kv_layout_for, tiny_llama
from kvtier.policies import LRU
from kvtier.scheduler.chunked_prefill import ChunkedPrefill
from kvtier.serve.scheduler import Request, ServeScheduler
from kvtier.tiers import DeviceTier, HostTier


DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def tiny():
    model = tiny_llama(seed=3, device=DEV)
    return model, kv_layout_for(model.config, page_size=8, dtype=torch.float32)


def make(model, layout, device_pages=64, host_pages=0, runner="auto", kernel=None):
    tiers = [DeviceTier(layout, device_pages, device=DEV)] + ([HostTier(layout, host_pages)] if host_pages else [])
    return Engine(model, layout, tiers, LRU(), prefill=ChunkedPrefill(64), kernel=kernel,
                  config=EngineConfig(max_batch=4, max_context=256, runner=runner))


def prompts(n, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (s,), generator=g).to(DEV) for s in lengths[:n]]


@pytest.mark.parametrize("runner,device_pages,host_pages,kernel",
                         [("auto", 64, 0, None), ("hf", 64, 0, None), ("auto", 12, 80, None), ("auto", 64, 0, "triton"),
                          ("auto", 64, 0, "triton split")])
def test_mixed_iteration_equals_each_sequence_alone(tiny, runner, device_pages, host_pages, kernel):
    """Two decoding sequences, a second chunk of one prompt and a first chunk of another in one forward (on the
    CPU with ``triton``: the Triton kernels through the interpreter, the chunks' calls planned once; ``split``:
    each query tile's keys split over three programs, against the sequences alone on the default kernel)."""
    model, layout = tiny
    p = prompts(4, [37, 21, 40, 19])
    if kernel == "triton split":
        backend = TritonBackend(prefill_config=PrefillConfig(block_m=32, block_n=16, kv_splits=3))
    else:
        backend = make_backend(kernel, DEV) if kernel else None
    mixed = make(model, layout, device_pages, host_pages, runner, backend)
    alone = make(model, layout, device_pages, host_pages, runner, None if kernel == "triton split" else backend)
    for e in (mixed, alone):  # two sequences decoding, one prompt half in
        for prompt in p[:2]:
            e.add(prompt)
            e.step()
    s2, s3 = (mixed.open(40), mixed.open(19))
    mixed.prefill_chunk(s2, p[2][:24])
    out = mixed.iterate([(s2, p[2][24:]), (s3, p[3])], all_logits=True)

    a2, a3 = alone.open(40), alone.open(19)
    alone.prefill_chunk(a2, p[2][:24])
    want_decode = alone.step()
    want_2 = alone.prefill_chunk(a2, p[2][24:], all_logits=True)
    want_3 = alone.prefill_chunk(a3, p[3], all_logits=True)

    assert out.logits.shape[0] == want_decode.shape[0]
    assert (out.logits[:2] - want_decode[:2]).abs().max() < 1e-4
    assert [x.shape[0] for x in out.chunk_logits] == [16, 19]
    assert (out.chunk_logits[0] - want_2).abs().max() < 1e-4
    assert (out.chunk_logits[1] - want_3).abs().max() < 1e-4
    for e, seqs in ((mixed, (s2, s3)), (alone, (a2, a3))):  # both go on decoding the same
        for s, logits in zip(seqs, (want_2, want_3)):
            e.start_decode(s, logits[-1].argmax())
    for _ in range(3):
        assert (mixed.step() - alone.step()).abs().max() < 1e-4


def test_last_logits_and_errors(tiny):
    model, layout = tiny
    p = prompts(2, [30, 12])
    e = make(model, layout)
    seq = e.open(30)
    out = e.iterate([(seq, p[0][:16])], decode=False)
    assert out.logits is None and out.chunk_logits[0].shape == (1, 256)
    with pytest.raises(KVTierError, match="two chunks of one sequence"):
        e.iterate([(seq, p[0][16:20]), (seq, p[0][20:])], decode=False)
    with pytest.raises(KVTierError, match="no running sequence"):
        e.iterate([(seq, p[0][16:])])


def serve(model, layout, requests, budget=40):
    engine = make(model, layout, device_pages=64)
    sched = ServeScheduler(engine, token_budget=budget)
    states = [sched.submit(Request(i, p.cpu().numpy(), 6, arrival_s=float(i))) for i, p in enumerate(requests)]
    while not sched.idle:
        sched.iterate()
    return sched, [s.output for s in states]


def test_radix_hit_runs_as_a_decode_row(tiny):
    """The second request repeats the first's prompt (33 tokens: 4 full pages and one token): it is admitted on
    the 4 cached pages and joins the decode rows with its last token; its tokens are a cold run's."""
    model, layout = tiny
    prompt = prompts(1, [33], seed=5)[0]
    _, cold = serve(model, layout, [prompt])
    sched, (first, again) = serve(model, layout, [prompt, prompt])
    assert first == again == cold[0]
    assert sched.stats.cached_tokens == 32
    assert sum(tokens for _, tokens, _ in sched.stats.composition) == 33  # the hit computed no chunk
    assert all(chunks <= 1 for _, _, chunks in sched.stats.composition)


def test_chunks_of_several_prompts_share_an_iteration(tiny):
    model, layout = tiny
    reqs = prompts(3, [20, 15, 9], seed=7)
    _, alone = zip(*[serve(model, layout, [r]) for r in reqs])
    sched, got = serve(model, layout, reqs, budget=64)
    assert got == [a[0] for a in alone]
    assert sched.stats.composition[0] == (0, 44, 3)
    assert np.all([d + t <= 64 for d, t, _ in sched.stats.composition])


@pytest.mark.skipif(DEV != "cuda", reason="captured iterations need a GPU (CUDA graphs)")
def test_captured_iteration_equals_eager(tiny):
    """Iterations of decode rows and chunks replayed from CUDA graphs at token buckets (one bucket replayed with
    other chunk lengths and counts) give the eager forward's logits."""
    model, layout = tiny
    p = prompts(4, [37, 21, 90, 120], seed=11)
    engines = []
    for graphs in (False, True):
        tiers = [DeviceTier(layout, 96, device=DEV)]
        engines.append(Engine(model, layout, tiers, LRU(), prefill=ChunkedPrefill(64),
                              config=EngineConfig(max_batch=4, max_context=256, graphs=graphs)))
    outs = []
    for e in engines:
        for prompt in p[:2]:
            e.add(prompt)
        s2, s3 = e.open(90), e.open(120)
        got = [e.iterate([(s2, p[2][:30]), (s3, p[3][:20])]),  # 50 tokens: bucket 64
               e.iterate([(s2, p[2][30:90])]),  # 60 tokens: the same bucket, one chunk
               e.iterate([(s3, p[3][20:45])]),  # 25 tokens: bucket 32
               e.iterate([(s3, p[3][45:48])]),  # 3 tokens: bucket 16, to page 6's end
               e.iterate([(s3, p[3][48:80])]),  # 32 tokens, exactly the bucket: writes into 4 pages
               e.iterate([(s3, p[3][80:84])]),
               e.iterate([(s3, p[3][84:116])]),  # the same graph, writes into 5 pages
               e.iterate([(s3, p[3][116:120])])]
        outs.append(got + [e.step(), e.step()])
    iterations = {key[:3] for key in engines[1].capture.graphs if isinstance(key, tuple)}
    assert iterations >= {("iteration", 2, 64), ("iteration", 2, 32), ("iteration", 2, 16)}  # + the prompts
    for eager, captured in zip(*outs):
        if isinstance(eager, torch.Tensor):
            assert (eager - captured).abs().max() < 1e-4
            continue
        assert (eager.logits - captured.logits).abs().max() < 1e-4
        for a, b in zip(eager.chunk_logits, captured.chunk_logits):
            assert (a - b).abs().max() < 1e-4


@pytest.mark.parametrize("kernel", [None, "triton"])
def test_planned_calls_equal_calls_planned_per_layer(tiny, kernel):
    """Chunks whose rows keep some pages on the host, attending the device's only (scope resident): each layer's
    two calls (the device pages seen whole, the tails) planned at once into the static lists give what the same
    calls built per layer give."""
    model, layout = tiny
    tiers = [DeviceTier(layout, 14, device=DEV), HostTier(layout, 80)]
    e = Engine(model, layout, tiers, LRU(), "resident", prefill=ChunkedPrefill(64),
               kernel=make_backend(kernel, DEV) if kernel else None, config=EngineConfig(max_batch=4, max_context=256))
    p = prompts(2, [70, 50], seed=2)
    s0, s1 = e.open(90), e.open(60)
    e.iterate([(s0, p[0]), (s1, p[1])], decode=False)  # 15 pages: some are moved to the host to make room
    e.planner.begin([(s0, 9), (s1, 6)], decode=False)
    attention = e.prefill_attention
    assert set(attention.planned) == set(range(layout.num_layers))
    assert (e.table.tier_of[:, np.concatenate([e.table.pages(s) for s in (s0, s1)])] == 1).any()
    q = torch.randn(15, model.config.num_attention_heads, layout.head_dim, device=DEV)
    for layer in range(layout.num_layers):
        planned = attention.calls(layer)
        assert len(planned) == 2 and not planned[0].batch.causal  # the whole-seen device pages, the tails
        window = layout.window(layer)
        direct = [attention._call(layer, *part, window - 1 if window and part[4] else -1)
                  for part in attention._parts(layer)]
        for a, b in zip(planned, direct):
            assert np.array_equal(a.pids, b.pids)
        (out_a, lse_a), (out_b, lse_b) = attention.run(planned, q, 0.25), attention.run(direct, q, 0.25)
        assert (out_a - out_b).abs().max() < 1e-5 and (lse_a - lse_b).abs().max() < 1e-5
    e.plan.mode = "idle"


def test_drop_prefix_cache_gives_every_page_back(tiny):
    model, layout = tiny
    prompt = prompts(1, [33], seed=5)[0]
    sched, _ = serve(model, layout, [prompt, prompt])
    assert sched.tree.num_pages == 4
    sched.submit(Request(9, prompt.cpu().numpy(), 2))
    with pytest.raises(KVTierError, match="idle"):
        sched.drop_prefix_cache()
    while not sched.idle:
        sched.iterate()
    sched.drop_prefix_cache()
    assert sched.tree.num_pages == 0 and not sched.engine.table.seqs
    assert sched.engine.pages.free_pages() == sched.engine.table.tiers[0].capacity - 1  # all but the scratch page


def causal_reference(q, k, v, scale):
    """Causal attention of ``q [T, H, D]`` over ``k, v [T, N_kv, D]`` in fp32: ``(out [T, H, D], lse [T, H])``."""
    T, H, _ = q.shape
    k, v = (x.float().repeat_interleave(H // x.shape[1], dim=1) for x in (k, v))  # [T, H, D]
    s = torch.einsum("thd,shd->hts", q.float(), k) * scale  # [H, T, T]
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse = s.logsumexp(-1)  # [H, T]
    return torch.einsum("hts,shd->thd", (s - lse[..., None]).exp(), v).to(q.dtype), lse.T


def test_cold_chunks_on_contiguous_kv_equal_their_paged_call(tiny, monkeypatch):
    """Uncaptured iterations (over CAPTURE_TOKENS tokens) of cold prompts' first chunks: each global layer's causal
    call runs on the chunks' contiguous K/V (here the fp32 reference in place of cuDNN); the logits equal the paged
    call's. A chunk over earlier pages (the second) and a captured one (the third) keep the paged call."""
    from kvtier.engine import prefill

    model, layout = tiny
    long, a, b = prompts(3, [2300, 700, 600], seed=7)
    engines = [Engine(model, layout, [DeviceTier(layout, 500, device=DEV)], LRU(), prefill=ChunkedPrefill(1104),
                      config=EngineConfig(max_batch=3, max_context=2304)) for _ in range(2)]
    engines[1].prefill_attention._own_ok = True  # on any device, with the reference kernel below
    own_calls = []
    monkeypatch.setattr(prefill, "own_causal", lambda *x: own_calls.append(x[0].shape[0]) or causal_reference(*x))
    want, got = (e.prefill_sequence(e.open(2300), long, all_logits=True) for e in engines)
    assert own_calls == [1104] * layout.num_layers  # chunks of 1,104, 1,104 and 92 tokens
    assert got.shape == want.shape == (2300, model.config.vocab_size)
    assert (got - want).abs().max() < 1e-4
    want, got = (e.iterate([(e.open(700), a), (e.open(600), b)], decode=False, all_logits=True).chunk_logits
                 for e in engines)  # two cold prompts in one iteration
    assert own_calls[layout.num_layers:] == [700, 600] * layout.num_layers
    assert all((x - y).abs().max() < 1e-4 for x, y in zip(got, want))


@pytest.mark.skipif(DEV != "cuda", reason="cuDNN's fused attention: a GPU")
def test_own_causal_kernel_equals_the_reference():
    """cuDNN's causal attention with GQA (4 query heads a kv head, strided views) and LSE, bf16, against the fp32
    reference."""
    from kvtier.kernels.own_causal import own_causal

    g = torch.Generator(device="cuda").manual_seed(11)
    qkv = torch.randn(1500, 48, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv[:, :32], qkv[:, 32:40], qkv[:, 40:]  # [T, 32 or 8, D] views, as a fused projection leaves them
    out, lse = own_causal(q, k, v, 128 ** -0.5)
    want_out, want_lse = causal_reference(q, k, v, 128 ** -0.5)
    assert out.shape == (1500, 32, 128) and lse.shape == (1500, 32) and lse.dtype == torch.float32
    assert (out.float() - want_out.float()).abs().max() < 2e-2
    assert (lse - want_lse).abs().max() < 1e-2
