"""InfiniteBench (Zhang et al., 2024; OpenBMB/InfiniteBench) from the Hugging Face cache
(``xinrongzhang2022/InfiniteBench``, ``<task>.jsonl``: ``hf download --repo-type dataset xinrongzhang2022/InfiniteBench``),
with its prompts for base models (``src/prompt.py``'s yarn-mistral templates, the answer's lead-in last), its
generation lengths and scoring (``src/compute_scores.py``), prompts cut in the middle to ``length`` tokens as its
``truncate_by_tokens``. Tasks here: the retrieval ones (passkey, number_string, kv_retrieval), longbook_qa_eng (qa
F1), longbook_choice_eng, longdialogue_qa_eng and math_find; ``path`` reads a local ``.jsonl`` of rows (each naming
its ``task``) instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from kvtier.errors import ConfigError
from kvtier.eval.generation import AnswerTask, Sample
from kvtier.eval.hf_data import dataset_file, read_rows
from kvtier.eval.longbench import fit_prompt, qa_f1
from kvtier.eval.perplexity import check_int

TEMPLATES = {  # src/prompt.py, yarn_mistral_templates
    "passkey": "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. I will "
               "quiz you about the important information.\n\n{context}\n\n{input}\n\nThe pass key is",
    "number_string": "There is an important info hidden inside a lot of irrelevant text. Find it. I will quiz you "
                     "about the important information there.\n\n{context}\n\n{input}\n\nThe sequence of digits is",
    "kv_retrieval": "Extract the value corresponding to the specified key in the JSON object below.\n\n{context}\n\n"
                    "{input}",
    "longbook_choice_eng": "Read the book and answer the question.\n\n{context}\n\nQuestion: {question}\nA. "
                           "{OPTION_A}\nB. {OPTION_B}\nC. {OPTION_C}\nD. {OPTION_D}\n\nThe letter of the correct "
                           "answer is",
    "longbook_qa_eng": "Read the book and answer the question. Be very concise in your answer.\n\n{context}\n\n"
                       "Question: {question}\nAnswer:",
    "math_find": "{prefix}\n\n{context}\n\n{input}",
    "longdialogue_qa_eng": "Below is a dialogue script where one random occurrence of a character name is replaced "
                           "with \"$$MASK$$\", and you should try to guess who that character is.\n\n{context}\n\n"
                           "The name that has been replaced with $$MASK$$ is likely",
}
MAX_NEW_TOKENS = {"passkey": 6, "number_string": 12, "kv_retrieval": 50, "longbook_choice_eng": 40,
                  "longbook_qa_eng": 40, "math_find": 3, "longdialogue_qa_eng": 40}  # src/eval_utils.py
REPOS = ("xinrongzhang2022/InfiniteBench",)


def first_int(text: str) -> str:
    return next((item for item in re.split("[^0-9]", text) if item), "")


def words_of(text: str) -> list[str]:
    """The answer's words, punctuation InfiniteBench strips made spaces."""
    for ch in "\n:\"'.,?!":
        text = text.replace(ch, " ")
    return text.split()


def choice_correct(pred: str, labels: list[str]) -> bool:
    """longbook_choice_eng: the first letter, or an option's text, or a lone A-D word among the answer's."""
    pred = pred.strip()
    if not pred:
        return False
    if pred[0] in "ABCD":
        return pred[0] in labels
    if pred in labels:
        return True
    return next((w in labels for w in words_of(pred) if w in "ABCD"), False)


def correct(task: str, pred: str, labels: list) -> float:
    """InfiniteBench's get_score_one for ``task`` (0-1)."""
    if task in ("passkey", "number_string"):
        return float(str(labels[0]) == first_int(pred))
    if task == "kv_retrieval":
        return float(str(labels[0]) in words_of(pred))
    if task == "longdialogue_qa_eng":
        return float(any(str(label).upper() in words_of(pred.upper()) for label in labels))
    if task == "longbook_choice_eng":
        return float(choice_correct(pred, [str(x) for x in labels]))
    if task == "math_find":
        found = re.search(r"\d+\.\d+|\d+", pred)
        return float(found is not None and float(found.group(0)) == float(labels[0]))
    return max(qa_f1(pred, str(label)) for label in labels)  # longbook_qa_eng


def prompt_and_labels(task: str, row: dict) -> tuple[str, list]:
    """InfiniteBench's create_prompt and get_answer for a row (``context``, ``input``, ``answer``, ``options``)."""
    fields = {"context": row["context"], "input": row["input"], "question": row["input"]}
    labels = row["answer"] if isinstance(row["answer"], list) else [row["answer"]]
    if task == "longbook_choice_eng":
        fields.update({f"OPTION_{c}": o for c, o in zip("ABCD", row["options"])})
        labels = [labels[0], "ABCD"[row["options"].index(labels[0])]]
    if task == "math_find":
        target = re.findall(r"The .+ of", row["input"])[0].lower()[:-3]
        fields["prefix"] = f"What is {target} in the following list?"
    return TEMPLATES[task].format(**fields), labels


@dataclass
class InfiniteBench(AnswerTask):
    """InfiniteBench's ``tasks``, prompts cut to ``length`` tokens, the first ``samples_per_task`` (null: all)."""

    length: int = 16384
    tasks: tuple = tuple(TEMPLATES)
    samples_per_task: int | None = None
    path: str | None = None
    name: ClassVar[str] = "infinitebench"

    def __post_init__(self):
        check_int("length", self.length, 16)
        if self.samples_per_task is not None:
            check_int("samples_per_task", self.samples_per_task, 1)
        self.tasks = tuple([self.tasks] if isinstance(self.tasks, str) else self.tasks)
        unknown = [t for t in self.tasks if t not in TEMPLATES]
        if unknown or not self.tasks:
            raise ConfigError("task.tasks", f"unknown InfiniteBench tasks {unknown}; kvtier runs {list(TEMPLATES)}")
        if self.path is not None and not Path(self.path).is_file():
            raise ConfigError("task.path", f"{self.path} is not a file; give a .jsonl of InfiniteBench rows")
        self.rows()  # in the cache (or the path): checked before the model loads

    @property
    def new_tokens(self) -> int:
        return max(MAX_NEW_TOKENS[t] for t in self.tasks)

    def rows(self) -> dict[str, list[dict]]:
        if self.path:
            local = read_rows(Path(self.path))
            found = {t: [r for r in local if r.get("task") == t] for t in self.tasks}
            if missing := [t for t, rows in found.items() if not rows]:
                raise ConfigError("task.path", f"{self.path} has no rows of {missing}")
        else:
            found = {t: read_rows(dataset_file(REPOS, t, ".jsonl")) for t in self.tasks}
        return {t: rows[:self.samples_per_task] for t, rows in found.items()}

    def samples(self, tokenizer):
        for task, rows in self.rows().items():
            for i, row in enumerate(rows):
                prompt, labels = prompt_and_labels(task, row)
                yield Sample(task, fit_prompt(tokenizer, prompt, self.length), labels, MAX_NEW_TOKENS[task],
                             {"index": i})

    def score(self, output: str, sample: Sample) -> float:
        return 100.0 * correct(sample.group, output, sample.refs)
