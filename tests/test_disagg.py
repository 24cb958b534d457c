"""Disaggregated prefill/decode on CPUs (gloo over loopback): the real SmolLM2 prefilled in this
process, its KV pages streamed layer by layer to a decode process, which must produce the same
greedy tokens as one process doing both."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from kvtier import DeviceTier, SinkWindow, install, kv_layout_for
from kvtier.cache import TieredKVCache
from kvtier.disagg import StreamingPrefillCache, prefill_and_send, transfer_model
from kvtier.errors import ConfigError
from kvtier.hook import use_hook
from kvtier.loopback import free_port
from kvtier.scheduler.chunked_prefill import ChunkedPrefill

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The light of the sun is made of rays of many colours. " * 8
CHUNK, NEW_TOKENS, PAGES = 32, 6, 20  # SinkWindow pins 18 pages, besides the scratch; few keep the CPU decode cheap

DECODE_WORKER = textwrap.dedent(f'''
    import json, sys, torch, torch.distributed as dist
    from kvtier import DeviceTier, SinkWindow, install, kv_layout_for, load_model
    from kvtier.cache import TieredKVCache
    from kvtier.disagg import decode, receive_prefill
    model, _ = load_model(None, dtype="float32", device="cpu", attn_implementation="sdpa")
    model.set_attn_implementation(install())
    layout = kv_layout_for(model.config, page_size=16, dtype=torch.float32)
    tier = DeviceTier(layout, {PAGES}, device="cpu")
    tier.alloc(1, 6)
    tier.free(1, torch.tensor([1, 3]))  # layer 1's pages land in scattered slots: received, then copied in
    cache = TieredKVCache(layout, [tier], SinkWindow())
    dist.init_process_group("gloo", init_method=sys.argv[1], rank=1, world_size=2)
    got = receive_prefill(cache, src=0)
    tokens = decode(model, cache, got.first_token, {NEW_TOKENS})
    print(json.dumps({{"tokens": tokens[0].tolist(), "bytes": got.received_bytes,
                      "arrival": got.layer_arrival_s}}), flush=True)
    dist.destroy_process_group()
''')



def one_process(model, layout, ids):
    """Prefill (chunks of CHUNK) and greedy decode in this process, the model's own forward over one
    TieredKVCache: token ids ``[NEW_TOKENS]``."""
    cache = TieredKVCache(layout, [DeviceTier(layout, PAGES, device="cpu")], SinkWindow())
    use_hook(model)
    with torch.no_grad():
        for a, b in ChunkedPrefill(CHUNK).chunks(ids.shape[1]):
            logits = model(input_ids=ids[:, a:b], past_key_values=cache, use_cache=True).logits
        tokens = [int(logits[0, -1].argmax())]
        for _ in range(NEW_TOKENS - 1):
            logits = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True).logits
            tokens.append(int(logits[0, -1].argmax()))
    cache.close()
    return tokens


def hf_greedy(model, ids, steps):
    """HF's own greedy tokens after ``ids [1, S]`` (sdpa attention, its KV cache)."""
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        out = model(ids, use_cache=True)
        tokens = [int(out.logits[0, -1].argmax())]
        for _ in range(steps - 1):
            out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def test_prefill_in_one_process_and_decode_in_another_match_one_process(smollm2):
    model, tok = smollm2
    ids = tok(PROMPT, return_tensors="pt").input_ids[:, :72]  # 72 tokens: 2 whole chunks and a partial page
    model.set_attn_implementation(install())
    try:
        layout = kv_layout_for(model.config, page_size=16, dtype=torch.float32)
        one = one_process(model, layout, ids)
        assert one == hf_greedy(model, ids, NEW_TOKENS)
        model.set_attn_implementation(install())

        url = f"tcp://127.0.0.1:{free_port()}"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        child = subprocess.Popen([sys.executable, "-c", DECODE_WORKER, url], env=env, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            dist.init_process_group("gloo", init_method=url, rank=0, world_size=2)
            tier = DeviceTier(layout, PAGES, device="cpu")
            tier.alloc(0, 6)
            tier.free(0, torch.tensor([1, 3]))  # layer 0's pages sit in scattered slots: gathered, then sent
            cache = StreamingPrefillCache(layout, [tier], SinkWindow(), dst=1)
            sent = prefill_and_send(model, cache, ids, CHUNK)
            out, err = child.communicate(timeout=240)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            child.kill()
        assert child.returncode == 0, err[-3000:]
        got = json.loads(out.strip().splitlines()[-1])
        assert got["tokens"] == one and sent.first_token == one[0]
        # every prompt page of every layer crossed exactly once: 5 pages x 30 layers
        expected = transfer_model(layout, ids.shape[1], link_gbps=1.0)["layer_bytes"] * layout.num_layers
        assert got["bytes"] == sent.sent_bytes == expected == 5 * layout.num_layers * layout.page_bytes
        assert len(got["arrival"]) == layout.num_layers and all(t > 0 for t in got["arrival"])
    finally:
        model.set_attn_implementation("sdpa")


def test_chunks_must_be_whole_pages_and_scope_topk_is_refused(smollm2):
    model, _ = smollm2
    layout = kv_layout_for(model.config, page_size=16, dtype=torch.float32)
    with pytest.raises(ConfigError, match="scope"):
        StreamingPrefillCache(layout, [DeviceTier(layout, PAGES, device="cpu")], SinkWindow(), dst=1,
                              scope="topk", topk_pages=4)
    cache = StreamingPrefillCache(layout, [DeviceTier(layout, PAGES, device="cpu")], SinkWindow(), dst=1)
    with pytest.raises(ConfigError, match="chunk_size.*24 is not a multiple of the page size 16"):
        prefill_and_send(model, cache, torch.zeros((1, 100), dtype=torch.int64), 24)
