"""Every mode of ``generate`` through kvtier (``offload`` / ``cache_for`` / ``TieredKVCache``) against HF's own on the
real SmolLM2 in fp32 under ``scope="all"``: the same tokens, logits within 1e-4, with pages moving between the device
and the host. On a GPU when there is one (the Triton decode kernel), else on the CPU (the torch reference)."""

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import kvtier
from kvtier.errors import ConfigError

TEXT = "The light of the sun is made of rays of many colours. "
NEW = 4
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNEL = "triton" if DEVICE == "cuda" else "torch"
EXACT = dict(policy="lru", hbm=0.3, tiers="device_host", scope="all", kernel=KERNEL)


@pytest.fixture(scope="module")
def model_tok(smollm2):
    """SmolLM2 (fp32) on the test device with its own attention; the hook's routing undone after the module."""
    model, tok = smollm2
    model.to(DEVICE).set_attn_implementation("sdpa")
    yield model, tok
    model.to("cpu").set_attn_implementation("sdpa")


def prompts(tok, repeats=(5,)):
    """Prompts of ``repeats`` sentences each, left-padded into one batch (input_ids, attention_mask)."""
    batch = tok([TEXT * k for k in repeats], return_tensors="pt", padding=True, padding_side="left")
    return {k: v.to(DEVICE) for k, v in batch.items()}


def generate_both(model, inputs, **kw):
    """HF's generate, then the same call inside ``kvtier.offload`` (scope all), each from seed 0: ``(hf, kvtier,
    the kvtier cache)``."""
    kw = dict(inputs, max_new_tokens=NEW, return_dict_in_generate=True, output_logits=True, **kw)
    model.set_attn_implementation("sdpa")
    torch.manual_seed(0)
    ref = model.generate(**kw)
    with kvtier.offload(model, **EXACT) as caches:
        torch.manual_seed(0)
        got = model.generate(**kw)
    return ref, got, caches[0]


def assert_exact(ref, got):
    assert torch.equal(ref.sequences, got.sequences), (ref.sequences[:, -NEW:], got.sequences[:, -NEW:])
    assert len(ref.logits) == len(got.logits)
    diff = max((a - b).abs().max().item() for a, b in zip(ref.logits, got.logits))
    assert diff < 1e-4, diff


MODES = {
    "greedy": ((5,), dict(do_sample=False)),
    "sampling": ((5,), dict(do_sample=True, top_k=50, temperature=0.9)),
    "beams 2": ((5,), dict(num_beams=2, do_sample=False)),
    "beams 4": ((5,), dict(num_beams=4, num_return_sequences=2, do_sample=False)),
    "3 samples": ((5,), dict(do_sample=True, num_return_sequences=3)),
    "left-padded 4": ((1, 2, 3, 5), dict(do_sample=False)),
}


@pytest.mark.parametrize("mode", MODES)
def test_generate_is_exact_against_hf(model_tok, mode):
    """The same tokens and logits; a prompt's rows (samples, beams) share its pages: prefilled once, its rows decode
    copy-on-write forks, the beams reordered by forking the chosen ones."""
    model, tok = model_tok
    repeats, kw = MODES[mode]
    inputs = prompts(tok, repeats)
    ref, got, cache = generate_both(model, inputs, **kw)
    assert_exact(ref, got)
    if "num_beams" in kw:
        torch.testing.assert_close(got.sequences_scores, ref.sequences_scores, atol=1e-4, rtol=0)
    assert kvtier.bytes_moved(cache)["device->host"] > 0  # pages did leave the device
    rows = max(kw.get("num_beams", 1), kw.get("num_return_sequences", 1))
    if rows > 1:  # the prompt's pages once, each row's own last pages (apart: rows x the prompt's)
        pages = -(-inputs["input_ids"].shape[1] // 16)
        assert max(sum(occ.values()) for _, occ in cache.stats.occupancy) <= pages + 2 * rows < rows * pages


def test_padding_is_never_stored_nor_attended(model_tok):
    """Each row of a left-padded batch holds its own tokens only: its length is its prompt's, not the batch's."""
    model, tok = model_tok
    inputs = prompts(tok, (1, 2, 3, 5))
    real = inputs["attention_mask"].sum(1).tolist()
    cache = kvtier.cache_for(model, max(real), NEW, batch_size=4, **EXACT)
    model.generate(**inputs, past_key_values=cache, max_new_tokens=NEW, do_sample=False)
    assert [cache.table.seq_len(s) for s in cache.seqs] == [n + NEW - 1 for n in real]  # the last token is not fed
    assert cache.get_seq_length() == inputs["input_ids"].shape[1] + NEW - 1  # HF's positions count the padding
    cache.close()


def test_padding_counts_in_no_budget(model_tok):
    """A batch padded past its longest prompt (``pad_to_multiple_of``: every row has padding): ``offload`` sizes
    the device budget from the longest prompt's own tokens, and the pages the rows hold are their tokens' only."""
    model, tok = model_tok
    inputs = tok([TEXT * k for k in (1, 5)], return_tensors="pt", padding=True, padding_side="left",
                 pad_to_multiple_of=128).to(DEVICE)
    real, width = inputs["attention_mask"].sum(1).tolist(), inputs["input_ids"].shape[1]
    assert max(real) < width - 32  # pages of padding in every row
    ref, got, cache = generate_both(model, dict(inputs), do_sample=False)
    assert_exact(ref, got)

    def device_pages(prompt_tokens):
        with kvtier.cache_for(model, prompt_tokens, NEW, batch_size=2, **EXACT) as sized:
            return sized.table.tiers[0].capacity
    assert cache.table.tiers[0].capacity == device_pages(max(real)) < device_pages(width)
    held = max(sum(occ.values()) for _, occ in cache.stats.occupancy) - 1  # pages in use, every tier (less the
    assert held == sum(-(-(n + NEW - 1) // 16) for n in real) < 2 * -(-(width + NEW - 1) // 16)  # batch's scratch)


class StopRow(StoppingCriteria):
    """Stop row ``row`` once it has ``after`` new tokens (a criterion of the user's, per row)."""

    def __init__(self, row: int, after: int, prompt: int):
        self.row, self.after, self.prompt = row, after, prompt

    def __call__(self, input_ids, scores, **kwargs):
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        done[self.row] = input_ids.shape[1] - self.prompt >= self.after
        return done


def test_stopping_criteria_stop_as_hf_does(model_tok):
    """A row that stops early is fed padding while the others go on."""
    model, tok = model_tok
    inputs = prompts(tok, (1, 2, 3, 5))
    width = inputs["input_ids"].shape[1]
    stop = StoppingCriteriaList([StopRow(0, 2, width)])
    ref, got, _ = generate_both(model, inputs, do_sample=False, stopping_criteria=stop, pad_token_id=0)
    assert_exact(ref, got)
    assert (ref.sequences[0, width + 2:] == 0).all() and (ref.sequences[1:, width + 2:] != 0).all()  # row 0 stopped


def test_generates_refusals_are_hfs_and_kvtiers_are_named(model_tok):
    model, tok = model_tok
    ids = prompts(tok)["input_ids"]
    calls = ({"max_new_tokens": 0}, {"max_new_tokens": 2, "bogus": 3})
    hfs = []
    for kw in calls:
        with pytest.raises(ValueError) as err:
            model.generate(ids, **kw)
        hfs.append(str(err.value))
    with kvtier.offload(model, **EXACT):
        for kw, hf in zip(calls, hfs):  # HF's own ValueError, word for word
            with pytest.raises(ValueError) as err:
                model.generate(ids, **kw)
            assert str(err.value) == hf
        with pytest.raises(ConfigError) as err:
            model.generate(ids[:, :0], max_new_tokens=2)
        assert err.value.field == "input_ids" and "empty" in str(err.value)
        right = tok([TEXT * 5, TEXT * 6], return_tensors="pt", padding=True, padding_side="right").to(DEVICE)
        with pytest.raises(ConfigError) as err:
            model.generate(**right, max_new_tokens=2)
        assert err.value.field == "attention_mask" and "padding_side='left'" in str(err.value)
    with pytest.raises(ConfigError) as err:
        kvtier.offload(model, bogus=1).__enter__()
    assert err.value.field == "bogus"
    for call in (lambda: kvtier.offload(object()).__enter__(), lambda: kvtier.cache_for(object(), 10)):
        with pytest.raises(ConfigError) as err:
            call()
        assert err.value.field == "model" and "PreTrainedModel" in str(err.value)
