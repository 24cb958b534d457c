"""kernel=flashinfer in the engine, without FlashInfer (a CPU): what the backend declares is checked against the
scope, policy, tiers and budget when the engine is built (named errors); its plan of a decode step (indptr, indices,
last page lengths from the block table and the page lists) attends what the engine's decode oracle attends on random
tables; and the whole engine, FlashInfer's wrappers stood in for by the torch reference behind the same plan/run
contract, decodes the tokens and logits of kernel=torch. The real wrappers: tests/test_gpu_flashinfer_engine.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier.budget import TokenBudget
from kvtier.engine import Engine, EngineConfig
from kvtier.errors import ConfigError, MissingDependencyError
from kvtier.kernels.base import PagedBatch
from kvtier.kernels.flashinfer import FlashInferBackend, decode_counts, paged_indices
from kvtier.kernels.reference import paged_attention_reference, static_decode_reference
from kvtier.kernels.triton_decode import plan_static_decode
from kvtier.layout import KVLayout
from kvtier.models import kv_layout_for, tiny_llama
from kvtier.policies import ASPE, LRU, Quest, SinkWindow
from kvtier.scopes import All, Resident, TopK
from kvtier.tiers import DeviceTier, HostTier

LN2 = float(np.log(2.0))


class ReferenceWrapper:
    """FlashInfer's wrapper contract (plan on host counts, the page indices read when it runs; LSE in base 2) over the
    torch reference: decode ``plan(indptr, indices, last, H, H_kv, D, P, **kw)``, prefill ``plan(qo_indptr, indptr,
    indices, last, H, H_kv, D, P, causal=, **kw)``."""

    def __init__(self):
        self.plans = 0

    def plan(self, *args, causal=False, sm_scale=None, window_left=-1, q_data_type=None, kv_data_type=None):
        qo, (indptr, indices, last, *_, page_size) = (None, args) if len(args) == 7 else (args[0], args[1:])
        self.qo, self.indptr, self.indices, self.last = qo, indptr.clone(), indices, last.clone()
        self.page_size, self.causal, self.sm_scale, self.window_left = page_size, causal, sm_scale, window_left
        self.plans += 1

    def run(self, q, pool, return_lse=True):
        qo = self.qo if self.qo is not None else torch.arange(q.shape[0] + 1, dtype=torch.int32)
        batch = PagedBatch(qo, self.indptr, self.indices, self.last, self.page_size, self.causal,
                           window_left=self.window_left)
        res = paged_attention_reference(q.float(), pool.float(), batch, self.sm_scale)
        return res.out.to(q.dtype), res.lse / LN2


def reference_flashinfer(plans: int = 4) -> FlashInferBackend:
    """kernel=flashinfer's own planning and indexing, its wrappers the torch reference (no FlashInfer here)."""
    backend = FlashInferBackend.__new__(FlashInferBackend)
    backend.use(ReferenceWrapper, ReferenceWrapper, "cpu", plans)
    return backend


@pytest.fixture(scope="module")
def tiny():
    model = tiny_llama(seed=5)
    return model, kv_layout_for(model.config, page_size=8, dtype=torch.float32)


def test_the_missing_dependency_names_the_extra():
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        with pytest.raises(MissingDependencyError, match=r"kvtier\[gpu\]|flashinfer-python"):
            FlashInferBackend(device="cpu")
    else:
        pytest.skip("flashinfer is installed here")


def test_what_flashinfer_cannot_do_is_refused_at_construction(tiny):
    model, layout = tiny
    dev = lambda n=64: DeviceTier(layout, n, device="cpu")  # noqa: E731
    host = lambda: HostTier(layout, 64)  # noqa: E731
    cases = {
        "scope": dict(tiers=[dev(16), host()], scope=TopK(4, unit="page")),  # picks from the query
        "scope.unit": dict(tiers=[dev()], scope=TopK(4)),  # key lists
        "kernel": dict(tiers=[dev()], policy=ASPE(sinks=4, window=8)),  # per-page statistics
        "cache.attend_budget": dict(tiers=[dev()], scope=Resident(), budget=TokenBudget(32, 4, 8, 8)),  # spans
        "cache.fidelity": dict(tiers=[dev()], scope=Resident(), fidelity=True),
        "cache.dense_layers": dict(tiers=[dev(16), host()], scope=Resident(), dense_layers=1),
    }
    for field, kw in cases.items():
        with pytest.raises(ConfigError) as err:
            Engine(model, layout, kw.pop("tiers"), kw.pop("policy", LRU()), kw.pop("scope", All()),
                   kernel=reference_flashinfer(), **kw)
        assert err.value.field == field, (field, str(err.value))
        assert "kernel=triton" in str(err.value)
    with pytest.raises(ConfigError) as err:  # host pages under scope=all: every attended page must be in HBM
        Engine(model, layout, [dev(16), host()], LRU(), All(), kernel=reference_flashinfer())
    assert err.value.field == "scope" and "scope=resident" in str(err.value)
    scaled = KVLayout(layout.num_layers, layout.num_kv_heads, layout.head_dim, 8, torch.bfloat16, kv_dtype="fp8_e4m3")
    with pytest.raises(ConfigError) as err:
        Engine(model, scaled, [DeviceTier(scaled, 64, device="cpu")], LRU(), All(), kernel=reference_flashinfer())
    assert err.value.field == "kv_dtype"
    # accepted: every attended page in HBM
    Engine(model, layout, [dev()], LRU(), All(), kernel=reference_flashinfer()).close()
    Engine(model, layout, [dev(16), host()], SinkWindow(4, 8), Resident(), kernel=reference_flashinfer()).close()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_decode_plan_attends_what_the_engine_oracle_attends(seed):
    """On a random block table (device slots, host slots, dropped pages) and random compacted page lists of device
    pages (resident's), or every page (all): the indices are the table's slots of the listed pages, and the paged
    batch they make gives the engine's decode oracle's output and LSE."""
    g = torch.Generator().manual_seed(seed)
    B, M, P, H, N_kv, D, slots = 5, 9, 4, 4, 2, 8, 64
    lens = torch.randint(1, M * P, (B,), generator=g)
    lens[2] = 0  # an idle row of the bucket
    table = torch.randperm(slots, generator=g)[:B * M].view(B, M).int()
    table[torch.rand(B, M, generator=g) < 0.3] = -3  # pages on the host
    n_pages = (lens + P - 1) // P
    logical = torch.arange(M)
    table[logical[None] == (n_pages - 1).clamp(min=0)[:, None]] = torch.arange(slots - B, slots).int()  # newest in HBM
    pool = torch.randn(slots, 2, P, N_kv, D, generator=g)
    q = torch.randn(B, H, D, generator=g)
    keep = (table >= 0) & (logical[None] < n_pages[:, None])
    lists = torch.where(keep, logical, M).sort(-1).values  # [B, M] ascending, then M
    lists = torch.where(lists < M, lists, -1).int()
    for page_list in (None, lists):
        counts = n_pages if page_list is None else (page_list >= 0).sum(-1)
        indptr, last = decode_counts(counts.numpy(), lens.numpy(), P)
        out = torch.full((int(indptr[-1]) + 1,), -7, dtype=torch.int32)
        paged_indices(table, page_list, torch.from_numpy(indptr), out)
        for b in range(B):  # the reference gather
            listed = logical[:int(n_pages[b])] if page_list is None else page_list[b][page_list[b] >= 0]
            want = table[b, listed.long()] if listed.numel() else table[b, :1]  # an idle row: its first entry
            want = want.clamp(min=0)  # (every page: a dropped one, left of a window, reads slot 0, masked there)
            assert torch.equal(out[indptr[b]:indptr[b + 1]], want)
        if page_list is None:
            continue  # every page: the host's would be read from a host pool, which FlashInfer never gets
        batch = PagedBatch(torch.arange(B + 1, dtype=torch.int32), torch.from_numpy(indptr), out[:-1],
                           torch.from_numpy(last), P, False)
        got = paged_attention_reference(q, pool, batch, D ** -0.5)
        plan = plan_static_decode(B, M, H, N_kv, D, P, "cpu", max_listed=M)
        ref_out, ref_lse = static_decode_reference(q, pool, None, table, lens.int(), plan, D ** -0.5,
                                                   page_list=page_list)
        live = lens > 0
        torch.testing.assert_close(got.out[live], ref_out[live], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.lse[live], ref_lse[live], rtol=1e-5, atol=1e-5)


def run_engine(model, layout, tiers, policy, scope, kernel, prompts, steps=6):
    engine = Engine(model, layout, tiers, policy, scope, kernel=kernel,
                    config=EngineConfig(max_batch=len(prompts), lookahead=1))
    for p in prompts:
        engine.add(p)
    logits = [engine.step() for _ in range(steps)]
    tokens = [lg.argmax(-1) for lg in logits]
    engine.close()
    return torch.stack(tokens), torch.stack(logits)


@pytest.mark.parametrize("stack", ["device", "resident"])
def test_flashinfer_planning_through_the_engine_decodes_as_torch(tiny, stack):
    """scope=all over one tier, and resident over device + host under Quest (pages move, and in some steps the
    layers' lists hold different counts): the plans from the host's counts and the indices from the device's lists
    decode kernel=torch's tokens and logits."""
    model, layout = tiny
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g) for n in (37, 20, 51)]

    def stack_of():
        if stack == "device":
            return [DeviceTier(layout, 64, device="cpu")], LRU(), All()
        return [DeviceTier(layout, 14, device="cpu"), HostTier(layout, 64)], Quest(sinks=4, window=8), Resident()

    want_tokens, want_logits = run_engine(model, layout, *stack_of(), "torch", prompts)
    backend = reference_flashinfer(plans=2)
    got_tokens, got_logits = run_engine(model, layout, *stack_of(), backend, prompts)
    assert torch.equal(got_tokens, want_tokens)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-4)
    planned = sum(p.wrapper.plans for p in backend.decodes.plans)  # once a step per distinct counts, not per layer
    assert planned == 6 if stack == "device" else 6 < planned < 6 * layout.num_layers
