"""Prediction ahead for the recall cache (tiny Llama, fp32; on a GPU the engine's defaults: Triton kernels, compiled
and captured steps, the copies on a side stream): a layer's query estimated from the hidden state before it, its
pages fetched before it runs; a prediction changes where pages are read, never what is attended."""

import pytest
import torch

from kvtier.cache import TieredKVCache
from kvtier.engine import Engine, EngineConfig
from kvtier.errors import ConfigError
from kvtier.kernels.registry import make_backend
from kvtier.models import kv_layout_for, tiny_llama
from kvtier.policies import SinkWindow
from kvtier.scheduler.chunked_prefill import ChunkedPrefill
from kvtier.scopes import TopK
from kvtier.scopes import recall as recall_module
from kvtier.scopes.recall import admission_batches
from kvtier.tiers import DeviceTier, DiskTier, HostTier


DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def tiny():
    """Weights drawn on the CPU, so that a GPU run makes the CPU run's choices (counts asserted below)."""
    model = tiny_llama(seed=1, device="cpu").to(DEV)
    return model, kv_layout_for(model.config, page_size=8, dtype=torch.float32)


class RandomQuery:
    """A predictor that knows nothing: a pseudo-random query of each layer and step, scrambled from the hidden state
    on the device (a captured step may copy no pageable host memory)."""

    point = "layer_input"

    def query(self, runner, layer, hidden, rope):
        heads = runner.model.config.num_attention_heads
        dim = runner.base.layers[layer].self_attn.head_dim
        x = hidden[:, -1].float().repeat(1, -(-heads * dim // hidden.shape[-1]))[:, :heads * dim]  # [B, H*D]
        return torch.sin(x * 4.1e3 * (layer + 1)).mul(43758.5453).frac().sub(0.5).view(-1, heads, dim)


def run(model, layout, predictor, steps=16, kernel=None, landing=0, unit="page", **config):
    """Greedy decode after a 150-token prompt, topk 4 pages (``unit="token"``: 4 pages' worth of keys) with 6 recall
    slots (and ``landing`` landing slots): ``(logits [steps + 1, V], engine)``."""
    tiers = [DeviceTier(layout, 18 + landing, device=DEV), HostTier(layout, 64)]
    scope = TopK(4, unit="page", rank="quest", recall_slots=6, predictor=predictor, landing_slots=landing) \
        if unit == "page" else TopK(4, recall_slots=6, predictor=predictor)
    engine = Engine(model, layout, tiers, SinkWindow(sinks=4, window=16), scope,
                    prefill=ChunkedPrefill(64), kernel=kernel, config=EngineConfig(max_context=256, **config))
    prompt = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(6)).to(DEV)
    logits = torch.stack([engine.add(prompt)[1][-1]] + [engine.step()[0].clone() for _ in range(steps)])
    return logits, engine


@pytest.mark.parametrize("predictor,unit", [("next_layer", "page"), ("after_attention", "page"),
                                            (RandomQuery(), "page"), ("next_layer", "token")])
def test_a_prediction_changes_no_output(tiny, predictor, unit):
    """InfiniGen's estimate (from the layer input, and after the attention: the decoder layer run in two parts)
    and a random one, for Quest's pages and for the key choice (the pages of its keys fetched ahead): the logits of
    the run without prediction; pages are fetched ahead, and at most those are counted as picked."""
    model, layout = tiny
    want, plain = run(model, layout, None, unit=unit)
    got, engine = run(model, layout, predictor, unit=unit)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5  # a split layer may fuse otherwise (GPU)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    recall = engine.recall
    assert int(recall.prefetched) > 0 and 0 <= int(recall.predicted) <= int(recall.prefetched)
    assert int(plain.recall.prefetched) == 0 and int(plain.recall.predicted) == 0


def test_a_compiled_bf16_step_rounds_as_eager_so_a_split_layer_changes_no_bit():
    """bf16 and torch.compile'd (:func:`kvtier.compiling.compile_step`: fused kernels round as eager does): the step
    gives eager's logits bit for bit, and so does the step that ``after_attention`` splits at the residual add.
    (Fused kernels that kept fp32 sums changed the logits of a 30-layer random model by 28%, and by 44% with the
    split.)"""
    model = tiny_llama(seed=1, device="cpu", dtype="bfloat16").to(DEV)
    layout = kv_layout_for(model.config, page_size=8, dtype=torch.bfloat16)
    eager, _ = run(model, layout, None, steps=4, graphs=False, compile=False)
    compiled, _ = run(model, layout, None, steps=4, graphs=False, compile=True)
    split, _ = run(model, layout, "after_attention", steps=4, graphs=False, compile=True)
    assert torch.equal(compiled, eager), (compiled - eager).abs().max()
    assert torch.equal(split, compiled), (split - compiled).abs().max()


def test_the_triton_backend_chooses_and_reads_as_the_torch_backend(tiny):
    """The Triton kernels (the page choice written into the step's lists, the decode reading recall slots and host
    pages in place and landing the host pages it reads; the interpreter on a CPU) with prediction ahead: the logits
    of the torch backend without either."""
    model, layout = tiny
    want, _ = run(model, layout, None, steps=5)
    got, engine = run(model, layout, "after_attention", steps=5, kernel=make_backend("triton", DEV), landing=2)
    assert engine.scope.fused and int(engine.recall.prefetched) > 0 and int(engine.recall.landed) > 0
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_the_triton_decode_reads_staged_disk_pages_beside_recall_and_landing(tiny, tmp_path):
    """A small host over a disk: most pages are staged for the step. The Triton decode (the interpreter on a CPU)
    reads them from the staging pool, lands only host pages, and its recall cache admits no staged page: the logits,
    hits and landings of the torch backend, eager and (on a GPU) captured."""
    model, layout = tiny
    prompt = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(6)).to(DEV)
    runs = {}
    eager = {"graphs": False, "compile": False}
    for name, kernel, config in (("torch", "torch", {}), ("triton eager", "triton", eager),
                                 *([("triton captured", "triton", {})] if DEV == "cuda" else [])):
        tiers = [DeviceTier(layout, 20, device=DEV), HostTier(layout, 4), DiskTier(layout, 64, tmp_path / name)]
        engine = Engine(model, layout, tiers, SinkWindow(sinks=4, window=16), TopK(4, unit="page", rank="quest", recall_slots=6, landing_slots=2),
                        prefill=ChunkedPrefill(64), kernel=make_backend(kernel, DEV),
                        config=EngineConfig(max_context=256, **config))
        logits = torch.stack([engine.add(prompt)[1][-1]] + [engine.step()[0].clone() for _ in range(8)])
        runs[name] = (logits, engine.hit_rate(), int(engine.recall.landed), engine.stats.fetched_bytes["disk->staging"])
    want, *counts = runs.pop("torch")
    assert counts[1] > 0 and counts[2] > 0
    for name, (got, *got_counts) in runs.items():
        assert got_counts == counts, f"{name}: hit rate, landed, staged bytes {got_counts}; torch {counts}"
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4, name


def test_admissions_in_batches_of_layers_keep_the_state_of_one_layer_at_a_time(tiny, monkeypatch):
    """The recall cache admits a batch of layers once the last of them has attended (runs within a layer group):
    one layer at a time or both layers together, the same cached pages, stamps, copies and logits."""
    assert admission_batches([range(0, 3), range(3, 20)]) == {2: range(0, 3), 10: range(3, 11), 18: range(11, 19),
                                                              19: range(19, 20)}
    model, layout = tiny
    runs = []
    for batch in (1, 2):
        monkeypatch.setattr(recall_module, "ADMIT_LAYERS", batch)
        logits, engine = run(model, layout, "after_attention", steps=8)
        assert len(engine.callbacks.admit_after) == 2 // batch
        runs.append((logits, [t.clone() for t in engine.recall.tensors()]))
    assert torch.equal(runs[0][0], runs[1][0]) and all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
    assert int(runs[0][1][3]) > 0  # pages were copied after their reads


def test_the_estimate_from_the_layers_own_input_is_its_query(tiny):
    """``LlamaRunner.layer_query`` given the hidden state entering the layer (not the one before) gives the query
    the layer's attention computes."""
    model, layout = tiny
    _, engine = run(model, layout, None, steps=0, graphs=False, compile=False)  # an eager step to look into
    seen, entering = {}, {}
    attend = engine.attend

    def spy(layer, query, scaling=None):
        seen[layer] = query[:, :, -1].clone()  # [B, H, D]
        return attend(layer, query, scaling)

    hooks = [layer.input_layernorm.register_forward_pre_hook(lambda m, args, i=i: entering.__setitem__(i, args[0]))
             for i, layer in enumerate(engine.runner.base.layers)]  # the hidden state entering each layer
    engine.attend = spy
    try:
        engine.step()
        rope = engine.runner.base.rotary_emb(entering[0], engine.buffers.positions[:1, None])
        for layer in range(layout.num_layers):
            est = engine.runner.layer_query(layer, entering[layer], rope)[:, :, -1]
            assert (est - seen[layer]).abs().max() < 1e-5
    finally:
        for h in hooks:
            h.remove()
        del engine.attend


def test_prediction_needs_the_recall_cache_and_the_compact_runner(tiny):
    model, layout = tiny
    for slots, land, taken in ((16, 0, "16 slots"), (12, 4, "12 slots and 1 x 4 landing slots")):
        with pytest.raises(ConfigError, match=rf"scope.recall_slots: 2 device pages \(of 18, less the recall cache's "
                                              rf"{taken}\) of 8 tokens cannot hold what policy 'sink_window' pins"):
            tiers = [DeviceTier(layout, 18, device=DEV), HostTier(layout, 64)]
            Engine(model, layout, tiers, SinkWindow(sinks=4, window=16),
                   TopK(4, unit="page", rank="quest", recall_slots=slots, landing_slots=land),
                   config=EngineConfig(max_context=256))  # the recall and landing slots leave 2 pages
    with pytest.raises(ConfigError, match="scope.predictor.*recall_slots"):
        TopK(4, unit="page", rank="quest", predictor="next_layer")
    with pytest.raises(ConfigError, match="scope.predictor.*unknown predictor 'infinigen'"):
        TopK(4, unit="page", rank="quest", recall_slots=4, predictor="infinigen")
    with pytest.raises(ConfigError, match="scope.predictor.*point must be one of"):
        TopK(4, unit="page", rank="quest", recall_slots=4, predictor=type("Mid", (RandomQuery,), {"point": "mid_mlp"})())
    with pytest.raises(ConfigError, match="scope.predictor.*compact runner"):
        run(model, layout, "next_layer", steps=0, runner="hf")


def test_the_recall_cache_survives_sequences_joining_and_leaving(tiny):
    """Three sequences through topk with recall slots (with and without prediction, with landing slots): one joins
    mid-run, one finishes and a new one takes its row. Each step's logits are those of the run without a recall
    cache (the same picks, read from wherever they are): a finished row's cached pages are never read for its
    successor."""
    model, layout = tiny
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=gen).to(DEV) for n in (90, 70, 60, 80)]
    runs = []
    for slots, predictor, land in ((0, None, 0), (8, None, 0), (8, "after_attention", 0), (8, None, 2)):
        tiers = [DeviceTier(layout, 30 + slots + 3 * land, device=DEV), HostTier(layout, 200)]
        engine = Engine(model, layout, tiers, SinkWindow(sinks=4, window=16),
                        TopK(4, unit="page", rank="quest", recall_slots=slots, predictor=predictor, landing_slots=land),
                        prefill=ChunkedPrefill(32),
                        config=EngineConfig(max_batch=3, max_context=160))
        out = [engine.add(p)[1][-1] for p in prompts[:2]]
        for step in range(14):
            if step == 3:
                out.append(engine.add(prompts[2])[1][-1])
            if step == 7:
                engine.finish(0)
                out.append(engine.add(prompts[3])[1][-1])  # takes the finished sequence's row
            out.append(engine.step().clone())
        runs.append((out, engine))
    for out, engine in runs[1:]:
        assert all(a.shape == b.shape and (a - b).abs().max() < 1e-5 * b.abs().max() for a, b in zip(out, runs[0][0]))
        assert int(engine.recall.copied) + int(engine.recall.prefetched) + int(engine.recall.landed) > 0
        assert engine.hit_rate() > runs[0][1].hit_rate()
    assert int(runs[2][1].recall.prefetched) > 0
    assert int(runs[3][1].recall.landed) > 0  # admitted from where the decode wrote them


def test_a_cache_driven_by_the_models_forward_ages_its_recall_cache(tiny):
    """A TieredKVCache with a user's TopK(recall_slots=...) (steps driven by the model's own forward): each decode
    step advances the recall cache's clock, so its slots keep taking the newest picks read from the host, and the
    cache's hit rate (prefill and decode) is above that of the same cache without recall slots."""
    model, layout = tiny
    ids = torch.randint(0, 256, (1, 150), generator=torch.Generator().manual_seed(6)).to(DEV)
    caches = []
    for slots in (0, 4):
        tiers = [DeviceTier(layout, 10 + slots, device=DEV), HostTier(layout, 64)]
        cache = TieredKVCache(layout, tiers, SinkWindow(sinks=4, window=16), scope=TopK(4, unit="page", rank="quest", recall_slots=slots))
        logits = cache.prefill(model, ids, chunk_size=64)
        for _ in range(12):
            logits = cache.forward(model, logits[:, -1:].argmax(-1))
        cache.finish_step()
        caches.append(cache)
    recall = caches[1].engine.recall
    assert int(recall.step) == 12 and int(recall.copied) > recall.slots.shape[1]  # more than one fill
    assert caches[1].hit_rate() > caches[0].hit_rate()
