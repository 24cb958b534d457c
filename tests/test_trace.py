"""Mooncake trace replay: token ids derived from the block hashes, time scaling, and the unbounded-cache
prefix hit ratio through the radix index against the traces' own figures (their README: block hit ratio
36.64% / 63.96%, prefix token hit ratio 37.36% / 65.12%)."""

import numpy as np
import pytest

from kvtier.errors import ConfigError
from kvtier.serve.trace import BLOCK, TraceRequest, load_trace, prompt_tokens, unbounded_hit_ratio


def test_tokens_follow_the_block_hashes():
    a = TraceRequest(0.0, 3 * BLOCK - 7, 1, (5, 9, 11))
    b = TraceRequest(0.0, 2 * BLOCK + 100, 1, (5, 9, 12))
    ta, tb = prompt_tokens(a, 49152), prompt_tokens(b, 49152)
    assert ta.shape == (3 * BLOCK - 7,) and tb.shape == (2 * BLOCK + 100,)
    assert np.array_equal(ta[:2 * BLOCK], tb[:2 * BLOCK])  # shared blocks: identical tokens
    assert not np.array_equal(ta[2 * BLOCK:2 * BLOCK + 100], tb[2 * BLOCK:])  # different third block
    assert ta.min() >= 0 and ta.max() < 49152


def test_load_and_time_scale():
    raw = load_trace("synthetic", start=10, limit=5)
    fast = load_trace("synthetic", time_scale=4.0, start=10, limit=5)
    assert len(raw) == 5 and raw[0].arrival_s == 0.0
    assert [r.arrival_s / 4 for r in raw] == pytest.approx([r.arrival_s for r in fast])
    assert all(len(r.hash_ids) == -(-r.input_length // BLOCK) for r in raw)
    with pytest.raises(ConfigError, match="unknown trace"):
        load_trace("toolagent")
    with pytest.raises(ConfigError, match="time_scale"):
        load_trace("synthetic", time_scale=0)


@pytest.mark.parametrize("name,blocks,tokens", [("conversation", 0.3664, 0.3736), ("synthetic", 0.6396, 0.6512)])
def test_unbounded_cache_reproduces_the_traces_hit_ratio(name, blocks, tokens):
    got = unbounded_hit_ratio(load_trace(name), page_size=128)
    assert abs(got.blocks - blocks) < 0.001
    assert abs(got.tokens - tokens) < 0.001
