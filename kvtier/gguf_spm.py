"""A SentencePiece-BPE tokenizer (Gemma's) rebuilt from the vocabulary a GGUF file carries.

A GGUF of a SentencePiece BPE model keeps each piece with its score (minus its merge rank) and type, but no
merges. transformers' GGUF import builds a *Unigram* model from those scores, which for BPE ranks prefers many
short pieces ("capital" in four pieces where Gemma has one ``▁capital``): every prompt is tokenized wrongly. Here
the merges are recovered as SentencePiece's own extractor does (every split of a piece into two vocabulary pieces,
ordered by the merged piece's score) and a byte-fallback BPE is built over them, with the normalizer (spaces to
``▁``, no dummy prefix), decoder and BOS of Gemma's own ``tokenizer.json``.
"""

from __future__ import annotations

from pathlib import Path

NORMAL, CONTROL, USER_DEFINED, BYTE = 1, 3, 4, 6  # llama.cpp's token types


def read_vocab(gguf: Path) -> dict:
    """``{"tokens": [str], "scores": [float], "types": [int], "bos": id, "eos": id, "unk": id, "pad": id,
    "add_bos": bool, "model": str}`` from the file's ``tokenizer.ggml.*`` fields."""
    from gguf import GGUFReader

    fields = GGUFReader(gguf).fields

    def array(key):
        f = fields[key]
        return [f.parts[i] for i in f.data]

    def scalar(key, default=None):
        return fields[key].parts[-1][0].item() if key in fields else default

    return {"tokens": [bytes(p).decode("utf-8") for p in array("tokenizer.ggml.tokens")],
            "scores": [float(p[0]) for p in array("tokenizer.ggml.scores")],
            "types": [int(p[0]) for p in array("tokenizer.ggml.token_type")],
            "bos": scalar("tokenizer.ggml.bos_token_id"), "eos": scalar("tokenizer.ggml.eos_token_id"),
            "unk": scalar("tokenizer.ggml.unknown_token_id"), "pad": scalar("tokenizer.ggml.padding_token_id"),
            "add_bos": bool(scalar("tokenizer.ggml.add_bos_token", True)),
            "model": bytes(fields["tokenizer.ggml.model"].parts[-1]).decode()}


def piece(token: str) -> str:
    """A GGUF token as the SentencePiece piece it was: llama.cpp writes whitespace-only pieces with spaces."""
    return "▁" * len(token) if token and not token.strip(" ") else token


def bpe_merges(vocab: dict[str, int], scores: list[float]) -> list[tuple[str, str]]:
    """Every ``(left, right)`` whose concatenation is a piece, both halves pieces too, in merge order: the merged
    piece's score, highest first (SentencePiece applies the best-scored merge first), then the halves' ids."""
    merges = []
    for merged, idx in vocab.items():
        for cut in range(1, len(merged)):
            left, right = merged[:cut], merged[cut:]
            if left in vocab and right in vocab:
                merges.append((-scores[idx], vocab[left], vocab[right], left, right))
    merges.sort()
    return [(left, right) for *_, left, right in merges]


def spm_bpe_tokenizer(gguf: Path):
    """A transformers fast tokenizer (``GemmaTokenizer`` class) equal to the SentencePiece BPE model in ``gguf``."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    v = read_vocab(gguf)
    if v["model"] != "llama":
        raise ValueError(f"{gguf} holds a {v['model']!r} tokenizer, not a SentencePiece one ('llama')")
    pieces = [piece(t) for t in v["tokens"]]
    vocab = {p: i for i, p in enumerate(pieces)}
    mergeable = {p: i for p, i in vocab.items() if v["types"][i] == NORMAL}
    tok = Tokenizer(BPE(vocab, bpe_merges(mergeable, v["scores"]), unk_token=pieces[v["unk"]], fuse_unk=True,
                        byte_fallback=True, dropout=None))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    # user-defined pieces (newline and space runs) are matched whole before BPE, as SentencePiece does
    tok.add_tokens([AddedToken(p, normalized="▁" in p, special=False) for i, p in enumerate(pieces)
                    if v["types"][i] == USER_DEFINED])
    tok.add_special_tokens([AddedToken(p, special=True, normalized=False) for i, p in enumerate(pieces)
                            if v["types"][i] == CONTROL])
    bos = pieces[v["bos"]]
    if v["add_bos"]:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, v["bos"])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=pieces[v["eos"]],
                                   unk_token=pieces[v["unk"]], pad_token=pieces[v["pad"]],
                                   add_bos_token=v["add_bos"], clean_up_tokenization_spaces=False)
