"""RULER (Hsieh et al., 2024, "RULER: What's the Real Context Size of Your Long-Context Language Models?"): its
synthetic tasks generated offline as its scripts (NVIDIA/RULER ``scripts/data/synthetic``) generate them, at any
length in the model's own tokens, and scored as its ``scripts/eval`` scores them.

Subtasks (RULER's names and settings, ``scripts/synthetic.yaml``): ``niah_single_1/2/3``, ``niah_multikey_1/2/3``,
``niah_multivalue``, ``niah_multiquery`` (needles "One of the special magic {numbers} for {key} is: {value}." in
noise, essay or needle haystacks), ``vt`` (variable tracking: a 4-hop chain of ``VAR X = VAR Y`` in noise, after one
worked example), ``cwe`` (the 10 common words of a numbered list), ``fwe`` (the 3 most frequent coded words of a
zeta-distributed text), ``qa_1``/``qa_2`` (SQuAD v2 / HotpotQA questions among distractor documents; only where
the dataset is in the Hugging Face cache, else skipped with a one-line reason in the result).

Each prompt is RULER's template and answer prefix ("base" model template) with the largest haystack whose prompt
plus the subtask's generated tokens fit ``length`` tokens (RULER's ``max_seq_length``; found by binary search as
RULER does), BOS included. Scoring (RULER's ``string_match_all`` / ``string_match_part``): the answer is stripped
and its control characters become newlines; ``all`` is the share of references found in it (case-insensitive),
``part`` whether any is; niah, vt, cwe and fwe report ``all``, qa ``part`` (0-100, per subtask and averaged).

Where this differs from RULER, for lack of the network: the essay haystack is a public-domain book shipped with
kvtier (``haystack``, Newton's Opticks by default) instead of Paul Graham's essays, which RULER downloads; its
sentences are cut at sentence ends by a regular expression instead of NLTK's punkt; keys and common words come from
the same word lists (the ``wonderwords`` package's, read from its installed files). A seed fixes every sample:
sample ``i`` of a subtask draws from ``random.Random(f"{seed}/{subtask}/{i}")``, whatever else is asked for.
"""

from __future__ import annotations

import importlib.metadata
import math
import random
import re
import string
import uuid
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import ClassVar

import torch

from kvtier.data import prompt_ids, text
from kvtier.errors import ConfigError
from kvtier.eval.generation import AnswerTask, Sample
from kvtier.eval.perplexity import check_int

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
DEPTHS = [round(100 * i / 39) for i in range(40)]  # RULER's 40 insertion depths, 0..100 %
DOCUMENT = "Document {i}:\n{document}"

# kind -> (template, answer prefix, tokens to generate, metric): RULER's scripts/data/synthetic/constants.py
KINDS = {
    "niah": ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
             "I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic "
             "{type_needle_v} for {query} mentioned in the provided text?",
             " The special magic {type_needle_v} for {query} mentioned in the provided text are", 128, "all"),
    "vt": ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
           "Question: Find all variables that are assigned the value {query} in the text above.",
           " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
           "assigned the value {query}, they are: ", 30, "all"),
    "cwe": ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
            "ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?",
            " Answer: The top 10 words that appear most often in the list are:", 120, "all"),
    "fwe": ("Read the following coded text and track the frequency of each coded word. Find the three most "
            "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
            "the dots '....'. What are the three most frequently appeared words in the above coded text?",
            " Answer: According to the coded text above, the three most frequently appeared words are:", 50, "all"),
    "qa": ("Answer the question based on the given documents. Only give me the answer and do not output any other "
           "words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given "
           "documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}",
           " Answer:", 32, "part"),
}


def niah(haystack, k="words", v="numbers", num_k=1, num_v=1, num_q=1):
    return "niah", dict(haystack=haystack, k=k, v=v, num_k=num_k, num_v=num_v, num_q=num_q)


SUBTASKS = {  # RULER's scripts/synthetic.yaml
    "niah_single_1": niah("noise"), "niah_single_2": niah("essay"), "niah_single_3": niah("essay", v="uuids"),
    "niah_multikey_1": niah("essay", num_k=4), "niah_multikey_2": niah("needle"),
    "niah_multikey_3": niah("needle", k="uuids", v="uuids"), "niah_multivalue": niah("essay", num_v=4),
    "niah_multiquery": niah("essay", num_q=4),
    "vt": ("vt", dict(num_chains=1, num_hops=4)),
    "cwe": ("cwe", dict(freq_cw=30, freq_ucw=3, num_cw=10)),
    "fwe": ("fwe", dict(alpha=2.0)),
    "qa_1": ("qa", dict(dataset="squad")),
    "qa_2": ("qa", dict(dataset="hotpotqa")),
}


# -- word lists -------------------------------------------------------------------------------------------------
WONDERWORDS = "wonderwords==3.0.1"


@cache
def word_list(name: str) -> tuple[str, ...]:
    """A word list of the ``wonderwords`` package (``nounlist``, ``adjectivelist``, ``verblist``), as RULER reads
    it (one word a line); ConfigError naming the pip command when it is not installed."""
    install = f"pip install --no-deps '{WONDERWORDS}'"
    try:
        path = Path(importlib.metadata.distribution("wonderwords").locate_file(f"wonderwords/assets/{name}.txt"))
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError("task", f"RULER's keys and words need the wonderwords package; run: {install}") from None
    if not path.is_file():
        raise ConfigError("task", f"{path} is missing from the installed wonderwords; run: {install}")
    return tuple(w.strip() for w in path.read_text().splitlines() if w.strip())


@cache
def cwe_words(seed: int) -> tuple[str, ...]:
    """cwe's vocabulary: nouns, adjectives and verbs, deduplicated, sorted, shuffled by the task's seed."""
    words = sorted(set(word_list("nounlist") + word_list("adjectivelist") + word_list("verblist")))
    random.Random(seed).shuffle(words)
    return tuple(words)


@cache
def essay_words(name: str) -> tuple[str, ...]:
    """The essay haystack: text ``name``'s words, whitespace runs made one space (RULER's ``split(" ")``)."""
    return tuple(re.sub(r"\s+", " ", text(name)).strip().split(" "))


_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+")


def sentences(words: str) -> list[str]:
    """``words`` cut after each sentence end (punkt's role in RULER)."""
    return [s for s in _SENTENCE_END.split(words) if s]


def random_value(kind: str, rng: random.Random) -> str:
    """A needle key or value: a 7-digit number, an adjective-noun pair, or a UUID (RULER's generate_random)."""
    if kind == "numbers":
        return str(rng.randint(10 ** 6, 10 ** 7 - 1))
    if kind == "words":
        return f"{rng.choice(word_list('adjectivelist'))}-{rng.choice(word_list('nounlist'))}"
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def insert_at_depths(sents: list[str], needles: list[str], rng: random.Random) -> str:
    """``needles`` placed among ``sents`` at distinct depths drawn from RULER's 40, in order, joined by spaces."""
    cuts = [0] + sorted(int(len(sents) * d / 100) for d in rng.sample(DEPTHS, len(needles))) + [len(sents)]
    parts = []
    for i in range(1, len(cuts)):
        parts.append(" ".join(sents[cuts[i - 1]:cuts[i]]))
        if i - 1 < len(needles):
            parts.append(needles[i - 1])
    return " ".join(parts)


# -- generators: (units of haystack, rng, task) -> (prompt text, references) -----------------------------------
def gen_niah(n: int, rng: random.Random, task: Ruler, haystack, k, v, num_k, num_v, num_q):
    num_k = max(num_k, num_q)
    keys, values, needles = [], [], []
    for _ in range(num_k):
        keys.append(random_value(k, rng))
        values.append([random_value(v, rng) for _ in range(num_v)])
        needles += [NEEDLE.format(type_needle_v=v, key=keys[-1], value=x) for x in values[-1]]
    rng.shuffle(needles)
    if haystack == "essay":
        words = essay_words(task.haystack)
        context = insert_at_depths(sentences(" ".join((words * -(-n // len(words)))[:n])), needles, rng)
    else:
        lines = [NOISE] * n if haystack == "noise" else [
            NEEDLE.format(type_needle_v=v, key=random_value(k, rng), value=random_value(v, rng)) for _ in range(n)]
        for at, needle in zip(sorted(rng.sample(range(n), len(needles)), reverse=True), needles):
            lines.insert(at, needle)
        context = "\n".join(lines)
    asked = rng.sample(range(num_k), num_q)
    queries = [keys[i] for i in asked]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if num_q > 1 else queries[0]
    template, prefix = KINDS["niah"][:2]
    template += prefix
    if num_q * num_v == 1:  # RULER's singular wording
        for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
            template = template.replace(old, new)
        v = v[:-1]
    return template.format(type_needle_v=v, context=context, query=query), [x for i in asked for x in values[i]]


def vt_chain(rng: random.Random, num_chains: int, num_hops: int) -> tuple[list[list[str]], list[list[str]]]:
    """``(variables, statements)`` per chain: ``VAR A = <5 digits>``, then ``VAR B = VAR A`` ... (``num_hops``)."""
    names = []
    while len(set(names)) < num_chains * (num_hops + 1):
        names.append("".join(rng.choices(string.ascii_uppercase, k=5)))
    names = list(dict.fromkeys(names))
    chains, statements = [], []
    for c in range(num_chains):
        var = names[c * (num_hops + 1):(c + 1) * (num_hops + 1)]
        chains.append(var)
        statements.append([f"VAR {var[0]} = {rng.randint(10000, 99999)}"] +
                          [f"VAR {var[j + 1]} = VAR {var[j]} " for j in range(num_hops)])
    return chains, statements


def vt_text(n: int, rng: random.Random, num_chains: int, num_hops: int) -> tuple[str, list[str]]:
    chains, statements = vt_chain(rng, num_chains, num_hops)
    lines = [NOISE] * n
    for chain in statements:
        for j, at in enumerate(sorted(rng.sample(range(len(lines)), len(chain)))):
            lines.insert(at + j, chain[j])
    context = "\n".join(lines).replace(". \n", ".\n")
    value = statements[0][0].split("=")[-1].strip()
    template, prefix = KINDS["vt"][:2]
    return (template + prefix).format(context=context, query=value, num_v=num_hops + 1), chains[0]


def gen_vt(n: int, rng: random.Random, task: Ruler, num_chains, num_hops):
    """RULER's one worked example (its own noise fitted to 500 tokens, answer given) before the question."""
    seed = rng.random()  # the example's draws, the same at every size tried
    shot, answer = task.fit_units(lambda m: vt_text(m, random.Random(seed), num_chains, num_hops), 500, 0, 5, 5)
    prompt, refs = vt_text(n, rng, num_chains, num_hops)
    return f"{shot} {' '.join(answer)}\n\n{prompt}", refs


def gen_cwe(n: int, rng: random.Random, task: Ruler, freq_cw, freq_ucw, num_cw):
    words = cwe_words(task.seed)
    if n > len(words):
        raise ConfigError("task.length", f"cwe at {task.length} tokens needs {n} distinct words, more than the "
                                         f"{len(words)} of its word lists; use a shorter length")

    def example(count, common, uncommon):
        chosen = rng.sample(words, count)
        listed = chosen[:num_cw] * common + chosen[num_cw:] * uncommon
        rng.shuffle(listed)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed)), chosen[:num_cw]

    small = task.length < 4096  # RULER's shorter lists below 4k
    shot, shot_answer = example(20, 3, 1) if small else example(40, 10, 3)
    context, answer = example(n, 6, 1) if small else example(n, freq_cw, freq_ucw)
    template = "".join(KINDS["cwe"][:2])
    shot_text = template.format(context=shot) + " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(shot_answer))
    return shot_text + "\n" + template.format(context=context), answer


def zeta(alpha: float, terms: int = 100_000) -> float:
    """Riemann zeta(alpha), alpha > 1: the partial sum and its Euler-Maclaurin tail."""
    return math.fsum(k ** -alpha for k in range(1, terms)) + terms ** (1 - alpha) / (alpha - 1) + terms ** -alpha / 2


def gen_fwe(n: int, rng: random.Random, task: Ruler, alpha):
    size = (task.length - KINDS["fwe"][2]) // 50  # RULER's vocab_size
    vocab = set()
    while len(vocab) < size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=6)))
    vocab = sorted(vocab)
    rng.shuffle(vocab)
    vocab[0] = "..."  # the most frequent is noise
    z = zeta(alpha)
    words = [w for k, w in enumerate(vocab, 1) for _ in range(int(n * k ** -alpha / z))]
    rng.shuffle(words)
    return "".join(KINDS["fwe"][:2]).format(context=" ".join(words)), vocab[1:4]


def gen_qa(n: int, rng: random.Random, task: Ruler, dataset, index):
    questions, docs = qa_data(dataset)
    q = questions[index % len(questions)]
    gold, more = q["context"], q.get("more", [])
    if n < len(docs):
        if n - len(gold) > len(more):
            others = [i for i in range(len(docs)) if i not in set(gold) | set(more)]
            chosen = gold + more + rng.sample(others, max(0, n - len(gold) - len(more)))
        else:
            chosen = gold + rng.sample(more, n - len(gold))
        chosen = [docs[i] for i in chosen]
    else:
        chosen = (docs * -(-n // len(docs)))[:n]
    rng.shuffle(chosen)
    context = "\n\n".join(DOCUMENT.format(i=i + 1, document=d) for i, d in enumerate(chosen))
    return "".join(KINDS["qa"][:2]).format(context=context, query=q["query"]), q["outputs"]


GENERATORS = {"niah": gen_niah, "vt": gen_vt, "cwe": gen_cwe, "fwe": gen_fwe, "qa": gen_qa}


def search_start(kind: str, args: dict, length: int) -> tuple[int, int]:
    """``(first, least)``: the haystack size whose tokens per unit set the search's upper bound (RULER's
    ``incremental``), and the smallest size tried (RULER's lower bound, made 1 where a sample needs no more: the
    essay, and fwe, whose search RULER starts from a word per 6 tokens)."""
    if kind == "niah":
        if args["haystack"] == "essay":
            return 500, 1
        return (25, 5) if length >= 4096 else (5, 5)
    if kind == "fwe":
        return max(length // 6, 10), 1
    return 10, 10  # vt (RULER's 5 hops need 5 lines), cwe (10 common words), qa


# -- QA datasets from the Hugging Face cache --------------------------------------------------------------------
QA_DATASETS = {"squad": ("rajpurkar/squad_v2", "squad_v2/validation-"),
               "hotpotqa": ("hotpotqa/hotpot_qa", "distractor/validation-")}


@cache
def qa_data(dataset: str) -> tuple[list[dict], list[str]]:
    """RULER's ``(questions, documents)`` of SQuAD v2 (answerable questions; the other paragraphs of a question's
    article first among its distractors) or HotpotQA (distractor setting), from the dataset's validation parquet in
    the Hugging Face cache (:func:`kvtier.eval.hf_data.dataset_file`)."""
    from kvtier.eval.hf_data import dataset_file, read_rows

    repo, prefix = QA_DATASETS[dataset]
    rows = read_rows(dataset_file(repo, prefix, ".parquet"))
    if dataset == "squad":
        return squad_questions(rows)
    return hotpotqa_questions(rows)


def squad_questions(rows: list[dict]) -> tuple[list[dict], list[str]]:
    """SQuAD v2 rows (``title``, ``context``, ``question``, ``answers.text``) as RULER reads its JSON."""
    docs = sorted({r["context"] for r in rows})
    index = {d: i for i, d in enumerate(docs)}
    by_title: dict[str, list[int]] = {}
    for r in rows:
        by_title.setdefault(r["title"], [])
        if index[r["context"]] not in by_title[r["title"]]:
            by_title[r["title"]].append(index[r["context"]])
    questions = [{"query": r["question"], "outputs": list(r["answers"]["text"]), "context": [index[r["context"]]],
                  "more": [i for i in by_title[r["title"]] if i != index[r["context"]]]}
                 for r in rows if len(r["answers"]["text"])]  # RULER keeps the answerable ones
    return questions, docs


def hotpotqa_questions(rows: list[dict]) -> tuple[list[dict], list[str]]:
    """HotpotQA distractor rows (``question``, ``answer``, ``context.title`` / ``context.sentences``)."""
    def paragraphs(r):
        return [f"{t}\n{''.join(s)}" for t, s in zip(r["context"]["title"], r["context"]["sentences"])]

    docs = sorted({p for r in rows for p in paragraphs(r)})
    index = {d: i for i, d in enumerate(docs)}
    return [{"query": r["question"], "outputs": [r["answer"]], "context": [index[p] for p in paragraphs(r)]}
            for r in rows], docs


# -- the task ---------------------------------------------------------------------------------------------------
def clean(output: str) -> str:
    """RULER's postprocess_pred: stripped, control characters made newlines."""
    return re.sub(r"[\x00-\x1f]", "\n", output.strip()).strip()


def string_match_all(output: str, refs: list[str]) -> float:
    return 100.0 * sum(r.lower() in output.lower() for r in refs) / len(refs)


def string_match_part(output: str, refs: list[str]) -> float:
    return 100.0 * max(r.lower() in output.lower() for r in refs)


@dataclass
class Ruler(AnswerTask):
    """RULER's subtasks at ``length`` tokens (prompt + generated, RULER's ``max_seq_length``), ``samples`` each."""

    length: int = 4096
    subtasks: tuple = tuple(SUBTASKS)
    samples_per_task: int = 1
    seed: int = 42
    haystack: str = "opticks"  # the essay haystack's text (kvtier.data.TEXTS)
    max_new_tokens: int | None = None  # None: RULER's per kind (niah 128, vt 30, cwe 120, fwe 50, qa 32)
    name: ClassVar[str] = "ruler"

    def __post_init__(self):
        check_int("length", self.length, 256)
        check_int("samples_per_task", self.samples_per_task, 1)
        check_int("seed", self.seed, 0)
        if self.max_new_tokens is not None:
            check_int("max_new_tokens", self.max_new_tokens, 1, 512)
        self.subtasks = tuple([self.subtasks] if isinstance(self.subtasks, str) else self.subtasks)
        unknown = [s for s in self.subtasks if s not in SUBTASKS]
        if unknown or not self.subtasks:
            raise ConfigError("task.subtasks", f"unknown RULER subtasks {unknown}; use some of {list(SUBTASKS)}")
        text(self.haystack)  # known and installed: checked before the model loads
        self._skipped = {}
        for s in self.subtasks:
            kind, args = SUBTASKS[s]
            if kind == "qa":
                try:
                    qa_data(args["dataset"])
                except ConfigError as e:  # not in the cache: this subtask is skipped, the reason kept
                    self._skipped[s] = str(e).split(": ", 1)[-1]

    @property
    def new_tokens(self) -> int:
        return max(self.tokens_for(s) for s in self.subtasks)

    @property
    def context_tokens(self) -> int:
        """``length`` less the most tokens a subtask generates: with ``new_tokens``, what every sample fits."""
        return self.length - self.new_tokens

    def tokens_for(self, subtask: str) -> int:
        return self.max_new_tokens or KINDS[SUBTASKS[subtask][0]][2]

    def skipped(self) -> dict[str, str]:
        return dict(self._skipped)

    def fit_units(self, make, budget: int, new_tokens: int, first: int, least: int):
        """``make(n) -> (text, refs)`` at the largest ``n >= least`` whose BOS + text + ``new_tokens`` fit ``budget``
        tokens (RULER's binary search, up to 3x the estimate from the tokens per unit at ``first`` units)."""
        def size(n):
            return len(prompt_ids(self.tokenizer, make(n)[0])) + new_tokens

        per_unit = size(first) / first
        lo, hi, best = least, max(int(budget / per_unit * 3), 2 * first), None
        while lo <= hi:
            mid = (lo + hi) // 2
            if size(mid) <= budget:
                best, lo = mid, mid + 1
            else:
                hi = mid - 1
        if best is None:
            raise ConfigError("task.length", f"{budget} tokens do not hold even the smallest prompt "
                                             f"({size(least)} tokens); raise task.length")
        return make(best)

    def samples(self, tokenizer):
        self.tokenizer = tokenizer
        for subtask in self.subtasks:
            if subtask in self._skipped:
                continue
            kind, args = SUBTASKS[subtask]
            first, least = search_start(kind, args, self.length)
            new = self.tokens_for(subtask)
            for i in range(self.samples_per_task):
                key = f"{self.seed}/{subtask}/{i}"
                extra = {"index": i} if kind == "qa" else {}

                def make(n, key=key, kind=kind, args=args, extra=extra):
                    return GENERATORS[kind](n, random.Random(key), self, **args, **extra)

                prompt, refs = self.fit_units(make, self.length, new, first, least)
                ids = prompt_ids(tokenizer, prompt)
                yield Sample(subtask, torch.tensor(ids, dtype=torch.long), refs, new, {"sample": i})

    def score(self, output: str, sample: Sample) -> float:
        metric = KINDS[SUBTASKS[sample.group][0]][3]
        return (string_match_all if metric == "all" else string_match_part)(clean(output), sample.refs)
