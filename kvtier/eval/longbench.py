"""LongBench (Bai et al., 2024; THUDM/LongBench) v1 and v2 from the Hugging Face cache, with its official prompts,
generation lengths, middle truncation and metrics (``LongBench/config/dataset2prompt.json``, ``dataset2maxlen.json``,
``metrics.py``, ``eval.py``; v2: ``prompts/0shot.txt`` and ``extract_answer``).

v1: the datasets of ``THUDM/LongBench`` (``zai-org/LongBench``), read from its ``data.zip`` (``data/<name>.jsonl``):
``hf download --repo-type dataset THUDM/LongBench``. A prompt longer than ``length`` tokens keeps its first and last
``length / 2`` (LongBench's truncation). Scores (0-100): qa F1 (narrativeqa, qasper, multifieldqa, hotpotqa,
2wikimqa, musique, triviaqa), ROUGE-L (the ``rouge`` package, as LongBench: gov_report, qmsum, multi_news, samsum),
classification (trec), retrieval and count (passage_*), code edit similarity (``fuzzywuzzy``'s ratio: lcc,
repobench-p); the Chinese datasets need jieba (the ``[bench]`` extra). Few-shot datasets (trec, triviaqa, samsum,
lsht) are scored on the answer's first line, samsum also stops at a newline, as LongBench's ``pred.py``.
v2: ``THUDM/LongBench-v2``'s ``data.json``, four choices, accuracy of the extracted letter.

``path`` reads a local ``.jsonl`` of LongBench rows instead (each naming its ``dataset``; v2 rows as data.json's):
the test suite's fixture, or your own copy.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from kvtier.data import prompt_ids
from kvtier.errors import ConfigError, MissingDependencyError
from kvtier.eval.generation import AnswerTask, Sample, stop_ids
from kvtier.eval.hf_data import dataset_file, read_rows
from kvtier.eval.perplexity import check_int

PROMPTS = {
    'narrativeqa': 'You are given a story, which can be either a novel or a movie script, and a question. Answer the question asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nStory: {context}\n\nNow, answer the question based on the story asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:',
    'qasper': 'You are given a scientific article and a question. Answer the question as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write "unanswerable". If the question is a yes/no question, answer "yes", "no", or "unanswerable". Do not provide any explanation.\n\nArticle: {context}\n\n Answer the question based on the above article as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write "unanswerable". If the question is a yes/no question, answer "yes", "no", or "unanswerable". Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:',
    'multifieldqa_en': 'Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based on the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:',
    'multifieldqa_zh': '阅读以下文字并用中文简短回答：\n\n{context}\n\n现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。\n\n问题：{input}\n回答：',
    'hotpotqa': 'Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:',
    '2wikimqa': 'Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:',
    'musique': 'Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:',
    'dureader': '请基于给定的文章回答下述问题。\n\n文章：{context}\n\n请基于上述文章回答下面的问题。\n\n问题：{input}\n回答：',
    'gov_report': 'You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:',
    'qmsum': 'You are given a meeting transcript and a query containing a question or instruction. Answer the query in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting transcript in one or more sentences.\n\nQuery: {input}\nAnswer:',
    'multi_news': 'You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\nNow, write a one-page summary of all the news.\n\nSummary:',
    'vcsum': '下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结：',
    'trec': 'Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}',
    'triviaqa': 'Answer the question based on the given passage. Only give me the answer and do not output any other words. The following are some examples.\n\n{context}\n\n{input}',
    'samsum': 'Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}',
    'lsht': '请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}',
    'passage_count': 'There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final count of unique paragraphs after removing duplicates. The output format should only contain the number, such as 1, 2, 3, and so on.\n\nThe final answer is: ',
    'passage_retrieval_en': 'Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number of the paragraph that the abstract is from. The answer format must be like "Paragraph 1", "Paragraph 2", etc.\n\nThe answer is: ',
    'passage_retrieval_zh': '以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n{context}\n\n下面是一个摘要\n\n{input}\n\n请输入摘要所属段落的编号。答案格式必须是"段落1"，"段落2"等格式\n\n答案是：',
    'lcc': 'Please complete the code given below. \n{context}Next line of code:\n',
    'repobench-p': 'Please complete the code given below. \n{context}{input}Next line of code:\n',
}
MAX_NEW_TOKENS = {'narrativeqa': 128, 'qasper': 128, 'multifieldqa_en': 64, 'multifieldqa_zh': 64, 'hotpotqa': 32, '2wikimqa': 32, 'musique': 32, 'dureader': 128, 'gov_report': 512, 'qmsum': 512, 'multi_news': 512, 'vcsum': 512, 'trec': 64, 'triviaqa': 32, 'samsum': 128, 'lsht': 64, 'passage_count': 32, 'passage_retrieval_en': 32, 'passage_retrieval_zh': 32, 'lcc': 64, 'repobench-p': 64}
V2_PROMPT = ("Please read the following text and answer the question below.\n\n<text>\n$DOC$\n</text>\n\nWhat is the "
             "correct answer to this question: $Q$\nChoices:\n(A) $C_A$\n(B) $C_B$\n(C) $C_C$\n(D) $C_D$\n\nFormat "
             "your response as follows: \"The correct answer is (insert answer here)\".")
V2_MAX_NEW_TOKENS = 128
FIRST_LINE = ("trec", "triviaqa", "samsum", "lsht")  # few-shot: scored on the first line
CHINESE = ("multifieldqa_zh", "dureader", "vcsum", "lsht", "passage_retrieval_zh")
ENGLISH = tuple(d for d in PROMPTS if d not in CHINESE)
V1_REPOS = ("THUDM/LongBench", "zai-org/LongBench")
V2_REPOS = ("THUDM/LongBench-v2", "zai-org/LongBench-v2")


# -- metrics (LongBench's metrics.py) ---------------------------------------------------------------------------
def normalize_answer(s: str) -> str:
    """Lower case, no punctuation, no articles, single spaces."""
    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", s).split())


def f1(prediction: list, truth: list) -> float:
    same = sum((Counter(prediction) & Counter(truth)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(prediction), same / len(truth)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, truth: str, **_) -> float:
    return f1(normalize_answer(prediction).split(), normalize_answer(truth).split())


def jieba_words(text: str) -> list[str]:
    try:
        import jieba
    except ImportError:
        raise MissingDependencyError("jieba", "bench", "LongBench's Chinese datasets") from None
    return list(jieba.cut(text, cut_all=False))


def qa_f1_zh(prediction: str, truth: str, **_) -> float:
    cn = "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
    drop = set(string.punctuation + cn)

    def words(text):
        return [w for w in ("".join(c for c in t.lower() if c not in drop and not c.isspace())
                            for t in jieba_words(text)) if w]
    return f1(words(prediction), words(truth))


def rouge_l(prediction: str, truth: str, **_) -> float:
    from rouge import Rouge

    try:
        return Rouge().get_scores([prediction], [truth], avg=True)["rouge-l"]["f"]
    except Exception:  # LongBench scores an answer ROUGE cannot read (empty, only dots) 0
        return 0.0


def rouge_l_zh(prediction: str, truth: str, **_) -> float:
    return rouge_l(" ".join(jieba_words(prediction)), " ".join(jieba_words(truth)))


def classification(prediction: str, truth: str, all_classes=(), **_) -> float:
    matches = [c for c in all_classes if c in prediction]
    matches = [c for c in matches if not (c in truth and c != truth)]
    return 1.0 / len(matches) if truth in matches else 0.0


def share_of_numbers(prediction: str, target: str) -> float:
    numbers = re.findall(r"\d+", prediction)
    return sum(n == target for n in numbers) / len(numbers) if numbers else 0.0


def retrieval(prediction: str, truth: str, **_) -> float:
    return share_of_numbers(prediction, re.findall(r"Paragraph (\d+)", truth)[0])


def retrieval_zh(prediction: str, truth: str, **_) -> float:
    return share_of_numbers(prediction, re.findall(r"段落(\d+)", truth)[0])


def count(prediction: str, truth: str, **_) -> float:
    return share_of_numbers(prediction, str(truth))


def code_sim(prediction: str, truth: str, **_) -> float:
    from fuzzywuzzy import fuzz

    line = next((ln for ln in prediction.lstrip("\n").split("\n") if not any(c in ln for c in ("`", "#", "//"))), "")
    return fuzz.ratio(line, truth) / 100


METRICS = {"narrativeqa": qa_f1, "qasper": qa_f1, "multifieldqa_en": qa_f1, "multifieldqa_zh": qa_f1_zh,
           "hotpotqa": qa_f1, "2wikimqa": qa_f1, "musique": qa_f1, "dureader": rouge_l_zh, "gov_report": rouge_l,
           "qmsum": rouge_l, "multi_news": rouge_l, "vcsum": rouge_l_zh, "trec": classification, "triviaqa": qa_f1,
           "samsum": rouge_l, "lsht": classification, "passage_retrieval_en": retrieval, "passage_count": count,
           "passage_retrieval_zh": retrieval_zh, "lcc": code_sim, "repobench-p": code_sim}


def extract_choice(response: str) -> str | None:
    """LongBench v2's extract_answer: the letter of "The correct answer is (X)" (or without parentheses)."""
    response = response.replace("*", "")
    found = re.search(r"The correct answer is \(([A-D])\)", response) or \
        re.search(r"The correct answer is ([A-D])", response)
    return found.group(1) if found else None


def truncate_middle(ids: list[int], length: int) -> list[int]:
    """The first and last ``length // 2`` of ``ids`` when they are longer than ``length`` (LongBench, InfiniteBench)."""
    return ids if len(ids) <= length else ids[:length // 2] + ids[-(length // 2):]


def fit_prompt(tokenizer, prompt: str, length: int) -> torch.Tensor:
    """``prompt`` tokenized (BOS first where the tokenizer adds one: :func:`~kvtier.data.prompt_ids`), cut in the
    middle to ``length`` tokens as LongBench does: its two halves decoded and tokenized again."""
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if len(ids) > length:
        half = truncate_middle(ids, length)
        prompt = tokenizer.decode(half[:length // 2], skip_special_tokens=True) + \
            tokenizer.decode(half[length // 2:], skip_special_tokens=True)
    return torch.tensor(truncate_middle(prompt_ids(tokenizer, prompt), length), dtype=torch.long)


@dataclass
class LongBench(AnswerTask):
    """LongBench ``version`` v1 (``datasets``) or v2, prompts cut to ``length`` tokens, ``samples`` per dataset (the
    first ones; null: all)."""

    length: int = 4096
    version: str = "v1"
    datasets: tuple = ENGLISH
    samples_per_dataset: int | None = None
    path: str | None = None
    name: ClassVar[str] = "longbench"

    def __post_init__(self):
        check_int("length", self.length, 16)
        if self.samples_per_dataset is not None:
            check_int("samples_per_dataset", self.samples_per_dataset, 1)
        if self.version not in ("v1", "v2"):
            raise ConfigError("task.version", f"must be v1 or v2, got {self.version!r}")
        self.datasets = tuple([self.datasets] if isinstance(self.datasets, str) else self.datasets)
        unknown = [d for d in self.datasets if d not in PROMPTS]
        if self.version == "v1" and (unknown or not self.datasets):
            raise ConfigError("task.datasets", f"unknown LongBench datasets {unknown}; use some of {list(PROMPTS)}")
        if self.path is not None and not Path(self.path).is_file():
            raise ConfigError("task.path", f"{self.path} is not a file; give a .jsonl of LongBench rows")
        self.rows()  # in the cache (or the path): checked before the model loads

    @property
    def new_tokens(self) -> int:
        return V2_MAX_NEW_TOKENS if self.version == "v2" else max(MAX_NEW_TOKENS[d] for d in self.datasets)

    def rows(self) -> dict[str, list[dict]]:
        """The rows of each dataset asked for (the first ``samples_per_dataset``)."""
        if self.version == "v2":
            found = {"v2": read_rows(Path(self.path)) if self.path else read_rows(dataset_file(V2_REPOS, "data",
                                                                                                ".json"))}
        elif self.path:
            local = read_rows(Path(self.path))
            found = {d: [r for r in local if r.get("dataset") == d] for d in self.datasets}
            missing = [d for d, rows in found.items() if not rows]
            if missing:
                raise ConfigError("task.path", f"{self.path} has no rows of {missing}")
        else:
            archive = dataset_file(V1_REPOS, "data", ".zip")
            found = {d: read_rows(archive, f"data/{d}.jsonl") for d in self.datasets}
        return {d: rows[:self.samples_per_dataset] for d, rows in found.items()}

    def samples(self, tokenizer):
        for dataset, rows in self.rows().items():
            for i, row in enumerate(rows):
                if self.version == "v2":
                    prompt = V2_PROMPT.replace("$DOC$", row["context"].strip()).replace("$Q$", row["question"].strip())
                    for letter in "ABCD":
                        prompt = prompt.replace(f"$C_{letter}$", row[f"choice_{letter}"].strip())
                    refs, new = [row["answer"]], V2_MAX_NEW_TOKENS
                else:
                    prompt, refs, new = PROMPTS[dataset].format(**row), row["answers"], MAX_NEW_TOKENS[dataset]
                yield Sample(dataset, fit_prompt(tokenizer, prompt, self.length), refs, new,
                             {"index": i, "all_classes": row.get("all_classes")})

    def stop(self, tokenizer, sample: Sample) -> frozenset:
        return stop_ids(tokenizer, newline=sample.group == "samsum")

    def score(self, output: str, sample: Sample) -> float:
        if self.version == "v2":
            return 100.0 * (extract_choice(output) == sample.refs[0])
        if sample.group in FIRST_LINE:
            output = output.lstrip("\n").split("\n")[0]
        metric = METRICS[sample.group]
        return 100.0 * max(metric(output, truth, all_classes=sample.info["all_classes"]) for truth in sample.refs)
