"""The front-end sweep (issue 60): bad or unusual inputs a new user tries, through kvtier's three doors, each
classed by what kvtier did with it.

    python -m bench.front_sweep [--only SUBSTR] [--isolate] [--out bench/results/front_sweep]

Doors: ``kvtier-run`` overrides (every recipe group and Hydra's own), the Python API (``offload``, ``cache_for``,
``TieredKVCache``, ``Engine``, ``generate``'s keywords) and files (a missing or damaged GGUF or ``config.json``, an
unwritable run folder, a recipe folder of the user's). Outcome classes:

- ``named``: one line, a kvtier error (or the error Hugging Face itself gives without kvtier) naming the key at fault
  (and its value, where the case says which);
- ``ok``: an unusual but valid input, run and used as given (the case's check on the result holds);
- ``traceback``: any other exception, or more than one line;
- ``silent``: it ran, and the input was ignored or misused (an invalid input accepted; a check on the result failed);
- ``late``: a named error that came only after the model loaded, though the input was known before;
- ``wrong_key``: a named error whose message does not name the key (or the value) at fault;
- ``refused``: a valid input refused;
- ``secret``: a password of the input printed.

``kvtier-run`` cases run in this process (``main()`` with the case's command line, from a fresh folder; the model
loaded once) or, with ``--isolate``, each in a fresh interpreter. Writes ``<out>.json`` and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "front_sweep"
SECRET = "hunter2pw"  # the password of every URL a case gives; never to be printed
# a run short enough for the sweep (about 5 s on one CPU core): the overrides every kvtier-run case starts from
BASE = ["progress=false", "logger=none", "task.length=128", "task.prefix=96", "budget.fraction=0.75",
        "scheduler.prefill.chunk_size=16", "cache.fidelity=false"]
CLASSES = ("named", "ok", "traceback", "silent", "late", "wrong_key", "refused", "secret")


@dataclass
class Case:
    """One input. ``cli``: kvtier-run's arguments (``{tmp}``: the case's own folder), over :data:`BASE` (a key the
    case sets replaces BASE's); ``call``: a Python door case, ``call(ctx)``. ``key``: what its error must name
    (None: a valid input, it must run, and ``check(result)`` say None, else why it was misused); ``value``: also
    named in the message; ``after_load``: the fault shows only while or after the model loads (allowed late)."""

    name: str
    door: str
    key: str | None = None
    cli: list[str] | None = None
    call: Callable | None = None
    value: str | None = None
    check: Callable | None = None
    after_load: bool = False
    base: bool = True
    setup: Callable | None = None  # setup(tmp): files the case needs


def cli(name, args, key=None, door="cli", **kw) -> Case:
    return Case(name, door, key, cli=args if isinstance(args, list) else args.split(), **kw)


def py(name, call, key=None, **kw) -> Case:
    return Case(name, "python", key, call=call, **kw)


def metric(name, want) -> Callable:
    """A check that the run's ``metrics.json`` has ``name`` == ``want``."""
    def check(m):
        got = m.get(name)
        return None if got == want else f"metrics[{name!r}] = {got!r}, expected {want!r}"
    return check


def config_is(path, want) -> Callable:
    """A check that the run's recorded config has ``path`` (dotted) == ``want``."""
    def check(m):
        node = m.get("config", {})
        for part in path.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        return None if node == want else f"config {path} = {node!r}, expected {want!r}"
    return check


# -- files the cases read ---------------------------------------------------------------------------------------
def write(tmp: Path, rel: str, text: str | bytes) -> None:
    p = tmp / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(text) if isinstance(text, bytes) else p.write_text(text)


LLAMA_CONFIG = json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
                           "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                           "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 512})


def cli_cases() -> list[Case]:
    """kvtier-run overrides, group by group."""
    c = [
        # model
        cli("model unknown", "model=gpt5", "model", value="gpt5"),
        cli("model.dtype int4", "model.dtype=int4", "model.dtype", value="int4"),
        cli("model.device tpu", "model.device=tpu", "model.device", value="tpu"),
        cli("model.device cuda without a GPU", "model.device=cuda", "model.device", value="cuda"),
        cli("model.path missing dir", "model=local model.path=/nonexistent/llama", "model.path",
            value="/nonexistent/llama"),
        cli("model=local without path", "model=local", "model.path"),
        cli("model=hf without id", "model=hf", "model.id"),
        cli("model=hf id not in cache", "model=hf model.id=nobody/no-such-model", "model.id",
            value="nobody/no-such-model"),
        cli("model.id malformed", "model=hf model.id=not_a_repo_id", "model.id", value="not_a_repo_id"),
        cli("model unknown key", "model.flash=true", "model.flash"),
        cli("model.attn_implementation bogus", "+model.attn_implementation=magic", "model.attn_implementation",
            value="magic"),
        cli("model.dtype float16 on CPU", "model.dtype=float16", None, check=config_is("model.dtype", "float16")),
        # task
        cli("task unknown", "task=summarize", "task", value="summarize"),
        cli("task.length 2", "task.length=2", "task.length", value="2"),
        cli("task.length negative", "task.length=-5", "task.length", value="-5"),
        cli("task.length text", "task.length=abc", "task.length", value="abc"),
        cli("task.length 128 alone (default budget too small for aspe)", ["task.length=128"], "budget.fraction",
            base=False),
        cli("task.length past the model's positions", "task.length=100000 task.prefix=16", "task.length",
            value="100000"),
        cli("task.prefix zero", "task.prefix=0", "task.prefix", value="0"),
        cli("task.prefix over length", "task.prefix=500", "task.prefix", value="500"),
        cli("task.text unknown", "task.text=hamlet", "task.text", value="hamlet"),
        cli("task.block_tokens zero", "task.block_tokens=0", "task.block_tokens", value="0"),
        cli("task unknown key", "task.temperature=0.7", "task.temperature"),
        cli("passkey context too short", "task=passkey task.context_tokens=10", "task.context_tokens", value="10"),
        cli("passkey depth over 1", "task=passkey task.context_tokens=256 task.depths=[1.5]", "task.depths",
            value="1.5"),
        cli("passkey samples zero", "task=passkey task.context_tokens=256 task.samples=0", "task.samples", value="0"),
        cli("passkey max_new_tokens zero", "task=passkey task.context_tokens=256 task.max_new_tokens=0",
            "task.max_new_tokens", value="0"),
        cli("needle depth negative", "task=needle task.depths=[-0.5]", "task.depths", value="-0.5"),
        cli("ruler unknown subtask", "task=ruler task.length=256 task.subtasks=[niah_nope]", "task.subtasks",
            value="niah_nope"),
        # budget
        cli("budget.fraction zero", "budget.fraction=0", "budget.fraction", value="0"),
        cli("budget.fraction 2", "budget.fraction=2", "budget.fraction", value="2"),
        cli("budget.fraction negative", "budget.fraction=-0.1", "budget.fraction", value="-0.1"),
        cli("budget.fraction nan", "budget.fraction=nan", "budget.fraction", value="nan"),
        cli("budget.fraction text", "budget.fraction=half", "budget.fraction", value="half"),
        cli("budget.tokens zero", "budget.tokens=0", "budget.tokens", value="0"),
        cli("budget.tokens negative", "budget.tokens=-64", "budget.tokens", value="-64"),
        cli("budget.tokens over context", "budget.tokens=1000000", "budget.tokens", value="1000000"),
        cli("budget.tokens one", "budget.tokens=1", "budget.tokens", value="1"),
        cli("budget.tokens float", "budget.tokens=64.5", "budget.tokens", value="64.5"),
        cli("budget.size garbage", "budget.size=lots budget.fraction=null", "budget.size", value="lots"),
        cli("budget.size one byte", "budget.size=1B budget.fraction=null", "budget.size", value="1B"),
        cli("budget.size huge", "budget.size=100TiB budget.fraction=null", "budget.size", value="100TiB"),
        cli("budget tokens and fraction both", "budget.tokens=64 budget.fraction=0.5", "budget.fraction"),
        cli("budget unknown key", "budget.pages=4", "budget.pages"),
        cli("budget.tokens 64", "budget.tokens=64", None, check=metric("budget_tokens", 64)),
        # cache
        cli("cache.sinks negative", "cache.sinks=-1 cache.attend_budget=true", "cache.sinks", value="-1"),
        cli("cache.window negative", "cache.window=-1 cache.attend_budget=true", "cache.window", value="-1"),
        cli("cache.mode unknown", "cache.mode=sometimes cache.attend_budget=true", "cache.mode", value="sometimes"),
        cli("cache.dense_layers 99", "cache.dense_layers=99", "cache.dense_layers", value="99"),
        cli("cache.dense_layers negative", "cache.dense_layers=-1", "cache.dense_layers", value="-1"),
        cli("cache.fidelity maybe", "cache.fidelity=maybe", "cache.fidelity", value="maybe"),
        cli("cache.window without attend_budget", "cache.window=32", "cache.window"),
        cli("cache.exact_prefill under scope all", "cache.exact_prefill=true scope=all budget.fraction=1.0",
            "cache.exact_prefill"),
        cli("cache.topk_pages moved", "cache.topk_pages=4", "cache.topk_pages"),
        cli("cache unknown key", "cache.size=4", "cache.size"),
        cli("cache.attend_budget window over budget", "cache.attend_budget=true cache.window=4096", "cache.window",
            value="4096"),
        # scope
        cli("scope unknown", "scope=nearby", "scope", value="nearby"),
        cli("scope.pages zero", "scope=topk scope.pages=0 budget.fraction=0.5", "scope.pages", value="0"),
        cli("scope.unit unknown", "scope=topk scope.unit=word budget.fraction=0.5", "scope.unit", value="word"),
        cli("scope.rank unknown", "scope=topk scope.rank=magic budget.fraction=0.5", "scope.rank", value="magic"),
        cli("scope.sketch_rank zero", "scope=topk scope.sketch_rank=0 budget.fraction=0.5", "scope.sketch_rank",
            value="0"),
        cli("scope.sketch_rank over head_dim", "scope=topk scope.sketch_rank=1000 budget.fraction=0.5",
            "scope.sketch_rank", value="1000"),
        cli("scope.recall_slots negative", "scope=topk scope.recall_slots=-1 budget.fraction=0.5",
            "scope.recall_slots", value="-1"),
        cli("scope.predictor unknown", "scope=topk scope.predictor=oracle budget.fraction=0.5", "scope.predictor",
            value="oracle"),
        cli("scope.pages under resident", "+scope.pages=4", "scope.pages"),
        cli("resident with the whole context", "budget.fraction=1.0", "budget.fraction"),
        cli("scope all, whole context", "scope=all budget.fraction=1.0", None, check=metric("scope", "all")),
        # policy
        cli("policy unknown", "policy=nope", "policy", value="nope"),
        cli("policy.window negative", "policy=sink_window policy.window=-1", "policy.window", value="-1"),
        cli("aspe theta over 1", "policy.theta_evict=2", "policy.theta_evict", value="2"),
        cli("aspe obs_window zero", "policy.obs_window=0", "policy.obs_window", value="0"),
        cli("policy unknown key", "policy=h2o policy.heavy=0.5", "policy.heavy"),
        cli("policy.sinks text", "policy.sinks=abc", "policy.sinks", value="abc"),
        cli("policy pins more than the budget", "policy=sink_window policy.window=120", "budget.fraction"),
        cli("policy target not a policy", "policy._target_=builtins.dict", "policy"),
        cli("policy target missing class", "policy._target_=kvtier.policies.Nope", "policy",
            value="Nope"),
        # tiers
        cli("tiers unknown", "tiers=nvme", "tiers", value="nvme"),
        cli("host.fraction zero", "tiers.stack.host.fraction=0", "tiers.stack.host.fraction", value="0"),
        cli("host.fraction negative", "tiers.stack.host.fraction=-1", "tiers.stack.host.fraction", value="-1"),
        cli("host.size garbage", "tiers.stack.host.size=big", "tiers.stack.host.size", value="big"),
        cli("host.size one byte", "tiers.stack.host.size=1B", "tiers.stack.host.size", value="1B"),
        cli("host.size huge", "tiers.stack.host.size=100TiB", "tiers.stack.host.size"),
        cli("host.capacity", "+tiers.stack.host.capacity=4", "tiers.stack.host.capacity"),
        cli("host too small for the context", "tiers.stack.host.fraction=0.01", "tiers.stack.host"),
        cli("device sized by fraction", "+tiers.stack.device.fraction=0.5", "tiers.stack.device"),
        cli("host target missing", "tiers.stack.host._target_=kvtier.tiers.Nope", "tiers.stack.host"),
        cli("host.pin_memory text", "+tiers.stack.host.pin_memory=perhaps", "tiers.stack.host.pin_memory",
            value="perhaps"),
        cli("disk.path under /proc", "tiers=device_host_disk tiers.stack.disk.path=/proc/kvtier",
            "tiers.stack.disk.path", value="/proc/kvtier"),
        cli("disk.path a file", "tiers=device_host_disk tiers.stack.disk.path={tmp}/afile",
            "tiers.stack.disk.path", setup=lambda t: write(t, "afile", "x")),
        cli("disk.fraction zero", "tiers=device_host_disk tiers.stack.disk.fraction=0", "tiers.stack.disk.fraction",
            value="0"),
        cli("disk.size over the free disk", "tiers=device_host_disk tiers.stack.disk.size=1PiB",
            "tiers.stack.disk"),
        cli("disk.fraction without a disk tier", "tiers.stack.disk.fraction=0.5", "tiers.stack.disk"),
        cli("remote.url password, nothing answers",
            f"tiers=device_host_remote tiers.stack.remote.url=redis://user:{SECRET}@127.0.0.1:1/0",
            "tiers.stack.remote.url"),
        cli("remote.url scheme", "tiers=device_host_remote tiers.stack.remote.url=http://127.0.0.1:1/",
            "tiers.stack.remote.url", value="http://127.0.0.1:1/"),
        cli("remote.timeout_s zero", "tiers=device_host_remote tiers.stack.remote.timeout_s=0",
            "tiers.stack.remote.timeout_s", value="0"),
        cli("remote.timeout_s negative", "tiers=device_host_remote tiers.stack.remote.timeout_s=-1",
            "tiers.stack.remote.timeout_s", value="-1"),
        cli("remote.ttl_s zero", "tiers=device_host_remote tiers.stack.remote.ttl_s=0", "tiers.stack.remote.ttl_s",
            value="0"),
        cli("remote local runs", "tiers=device_host_remote", None, check=metric("tiers", "device_host_remote")),
        # scheduler
        cli("chunk_size zero", "scheduler.prefill.chunk_size=0", "scheduler.prefill.chunk_size", value="0"),
        cli("chunk_size negative", "scheduler.prefill.chunk_size=-16", "scheduler.prefill.chunk_size", value="-16"),
        cli("chunk_size text", "scheduler.prefill.chunk_size=big", "scheduler.prefill.chunk_size", value="big"),
        cli("chunk_size over the budget", "scheduler.prefill.chunk_size=4096", "scheduler.prefill.chunk_size"),
        cli("max_moves zero", "scheduler.placement.max_moves_per_step=0", "scheduler.placement.max_moves_per_step",
            value="0"),
        cli("placement not a scheduler", "scheduler.placement._target_=collections.OrderedDict",
            "scheduler.placement"),
        cli("scheduler unknown", "scheduler=fifo", "scheduler", value="fifo"),
        # engine
        cli("engine.max_batch zero", "engine.max_batch=0", "engine.max_batch", value="0"),
        cli("engine.max_context one", "engine.max_context=1", "engine.max_context", value="1"),
        cli("engine.max_context under the task", "engine.max_context=64", "engine.max_context", value="64"),
        cli("engine.graphs on a CPU", "engine.graphs=true", "engine.graphs"),
        cli("engine.compile maybe", "engine.compile=maybe", "engine.compile", value="maybe"),
        cli("engine.runner unknown", "engine.runner=vllm", "engine.runner", value="vllm"),
        cli("engine.lookahead negative", "engine.lookahead=-1", "engine.lookahead", value="-1"),
        cli("engine.buckets over max_batch", "engine.buckets=[4]", "engine.buckets", value="4"),
        cli("engine unknown key", "engine.threads=4", "engine.threads"),
        cli("engine.runner hf", "engine.runner=hf", None, check=config_is("engine.runner", "hf")),
        # kernel
        cli("kernel unknown", "kernel=cutlass", "kernel", value="cutlass"),
        # top level
        cli("page_size 24", "page_size=24", "page_size", value="24"),
        cli("page_size zero", "page_size=0", "page_size", value="0"),
        cli("page_size over context", "page_size=4096", "page_size"),
        cli("kv_dtype int4", "kv_dtype=int4", "kv_dtype", value="int4"),
        cli("cpu_threads zero", "cpu_threads=0", "cpu_threads", value="0"),
        cli("progress maybe", "progress=maybe", "progress", value="maybe"),
        cli("unknown top key", "+seed=3", "seed"),
        cli("unknown key without +", "foo=1", "foo"),
        cli("override syntax", "budget.fraction==0.5", "budget.fraction"),
        cli("kv_dtype int8 runs", "kv_dtype=int8", None, check=config_is("kv_dtype", "int8")),
        # logger
        cli("logger unknown", "logger=slack", "logger", value="slack"),
        cli("wandb mode bogus", "logger=wandb logger.mode=sometimes", "logger.mode", value="sometimes"),
        cli("wandb online without network", "logger=wandb logger.mode=online", "logger.mode", value="online"),
        # hydra
        cli("hydra.run.dir under /proc", "hydra.run.dir=/proc/kvtier-run", "hydra.run.dir"),
        cli("hydra.run.dir a file", "hydra.run.dir={tmp}/afile/run", "hydra.run.dir",
            setup=lambda t: write(t, "afile", "x")),
        cli("sweep.dir under /proc", "-m budget.fraction=0.5,0.75 hydra.sweep.dir=/proc/kvtier-sweep",
            "hydra.sweep.dir"),
        cli("submitit_slurm without Slurm", "-m hydra/launcher=submitit_slurm budget.fraction=0.5,0.75",
            "hydra/launcher"),
        cli("launcher unknown", "-m hydra/launcher=kubernetes budget.fraction=0.5,0.75", "hydra/launcher",
            value="kubernetes"),
        cli("sweep with one bad job", "-m budget.fraction=0.75,2", "budget.fraction", value="2"),
        cli("sweep of an unread key", "-m cache.window=16,32", "cache.window"),
        cli("experiment unknown", "+experiment=nope", "experiment", value="nope"),
        cli("config name unknown", "-cn nope", "config", value="nope"),
        cli("config-dir missing", "--config-dir /nonexistent/recipes policy=mine", "policy"),
        cli("config-dir bad YAML", "--config-dir {tmp}/recipes policy=mine", "policy",
            setup=lambda t: write(t, "recipes/policy/mine.yaml", "_target_: [unclosed\n")),
        cli("config-dir target missing module", "--config-dir {tmp}/recipes policy=mine", "policy",
            value="nomodule.Mine",
            setup=lambda t: write(t, "recipes/policy/mine.yaml", "_target_: nomodule.Mine\n")),
        cli("config-dir recipe a list", "--config-dir {tmp}/recipes policy=mine", "policy",
            setup=lambda t: write(t, "recipes/policy/mine.yaml", "- 1\n- 2\n")),
    ]
    return c


def file_cases() -> list[Case]:
    """Files a user points kvtier at."""
    def local(rel):
        return f"model=local model.dtype=float32 model.path={{tmp}}/{rel}"
    return [
        cli("gguf missing", local("none.gguf"), "model.path", door="file", value="none.gguf"),
        cli("gguf corrupt", local("bad.gguf"), "model.path", door="file", value="bad.gguf", after_load=True,
            setup=lambda t: write(t, "bad.gguf", os.urandom(4096))),
        cli("gguf empty", local("empty.gguf"), "model.path", door="file", value="empty.gguf", after_load=True,
            setup=lambda t: write(t, "empty.gguf", b"")),
        cli("gguf header then garbage", local("head.gguf"), "model.path", door="file", value="head.gguf",
            after_load=True, setup=lambda t: write(t, "head.gguf", b"GGUF\x03\x00\x00\x00" + os.urandom(256))),
        cli("config.json a JSON array", local("arr"), "model", door="file", value="arr/config.json",
            setup=lambda t: write(t, "arr/config.json", "[1, 2, 3]")),
        cli("config.json not JSON", local("notjson"), "model", door="file", value="notjson/config.json",
            setup=lambda t: write(t, "notjson/config.json", "{model_type: llama,")),
        cli("config.json missing", local("noconfig"), "model.path", door="file",
            setup=lambda t: write(t, "noconfig/tokenizer.json", "{}")),
        cli("config.json without weights", local("noweights"), "model.path", door="file", after_load=True,
            setup=lambda t: write(t, "noweights/config.json", LLAMA_CONFIG)),
        cli("config.json unknown model_type", local("unknowntype"), "model", door="file", value="zebra",
            setup=lambda t: write(t, "unknowntype/config.json", json.dumps({"model_type": "zebra"}))),
        cli("config.json of an encoder", local("bert"), "model", door="file",
            setup=lambda t: write(t, "bert/config.json", json.dumps({"model_type": "bert", "hidden_size": 64,
                                                                     "num_attention_heads": 4,
                                                                     "num_hidden_layers": 2}))),
        cli("model.path a plain file", local("plain.txt"), "model.path", door="file",
            setup=lambda t: write(t, "plain.txt", "hello")),
        cli("run dir on a read-only file system", "hydra.run.dir=/sys/kvtier-run", "hydra.run.dir", door="file"),
        py("recipe file a JSON array (load_model)", lambda x: x.kvtier.load_model(str(x.setup_array())),
           "model", value="arr/config.json"),
    ]


# -- the Python door --------------------------------------------------------------------------------------------
class Ctx:
    """What the Python cases share: kvtier, the model (loaded once), a prompt, a scratch folder."""

    def __init__(self, tmp: Path):
        import kvtier

        self.kvtier, self.tmp = kvtier, tmp
        self._model = None

    @property
    def model(self):
        if self._model is None:
            self._model = self.kvtier.load_model("smollm2", dtype="float32")
        return self._model[0]

    @property
    def tokenizer(self):
        self.model
        return self._model[1]

    def ids(self, n=160, rows=1):
        import torch

        from kvtier.data import token_stream

        ids = token_stream(self.tokenizer, "opticks", n)[None]  # [1, n]
        return ids.repeat(rows, 1) if rows > 1 else ids

    def layout(self, **kw):
        return self.kvtier.KVLayout(**{"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "page_size": 4,
                                       "dtype": "float32", **kw})

    def device(self, capacity=8, layout=None):
        return self.kvtier.DeviceTier(layout or self.layout(), capacity, device="cpu")

    def setup_array(self):
        write(self.tmp, "arr/config.json", "[]")
        return self.tmp / "arr"

    def offload_generate(self, options=None, **generate):
        """``model.generate`` inside ``kvtier.offload(model, **options)``; the new tokens."""
        ids = generate.pop("input_ids", self.ids())
        options = {"hbm": 0.5, **(options or {})}
        with self.kvtier.offload(self.model, **options):
            return self.model.generate(ids, **{"max_new_tokens": 4, "do_sample": False, **generate})

    def same_as_hf(self, options=None, seed=None, **generate):
        """``generate`` with and without kvtier (``scope='all'``): None when both give the same tokens, else why
        not; an error HF itself gives is raised as it is."""
        import torch

        ids = generate.pop("input_ids", self.ids())
        kwargs = {"max_new_tokens": 4, "do_sample": False, **generate}
        if seed is not None:
            torch.manual_seed(seed)
        hf_error = None
        try:
            want = self.model.generate(ids, **kwargs)
        except Exception as e:  # HF's own refusal: kvtier must refuse it the same way (or by name)
            hf_error = e
        if seed is not None:
            torch.manual_seed(seed)
        try:
            with self.kvtier.offload(self.model, **{"hbm": 1.0, "scope": "all", **(options or {})}):
                got = self.model.generate(ids, **kwargs)
        except Exception as e:
            if hf_error is not None and type(e) is type(hf_error) and str(e) == str(hf_error):
                raise HFError(f"{type(e).__name__}: {e}") from None
            raise
        if hf_error is not None:
            return f"HF refuses it ({type(hf_error).__name__}: {hf_error}); kvtier ran it"
        want = want.sequences if hasattr(want, "sequences") else want
        got = got.sequences if hasattr(got, "sequences") else got
        if want.shape != got.shape or not torch.equal(want, got):
            return f"tokens differ from HF's: {want.tolist()} vs {got.tolist()}"
        return None


class HFError(Exception):
    """Hugging Face's own error for an input it refuses, given through kvtier unchanged."""


def python_cases() -> list[Case]:
    def cache_for(x, *a, **kw):
        return x.kvtier.cache_for(x.model, *a, **kw).close()

    def tkv(x, *a, **kw):
        from kvtier.policies import LRU

        args = list(a) or [x.layout(), [x.device()], LRU()]
        return x.kvtier.TieredKVCache(*args, **kw)

    def engine(x, model=None, config=None, **kw):
        from kvtier.policies import LRU

        layout = x.kvtier.kv_layout_for(x.model.config, page_size=16, dtype="float32") if model is not None \
            else x.layout()
        return x.kvtier.Engine(model, layout, [x.kvtier.DeviceTier(layout, 32, device="cpu"),
                                               x.kvtier.HostTier(layout, 64)], kw.pop("policy", LRU()),
                               config=config, **kw)

    def engine_add(x, prompt):
        e = engine(x, model=x.model, scope="all")
        try:
            e.add(prompt)
        finally:
            e.close()

    def padded(x, n=120):
        import torch

        ids = x.ids(n, rows=2)
        mask = torch.ones_like(ids)
        ids[1, :10] = x.tokenizer.pad_token_id or 0
        mask[1, :10] = 0
        return {"input_ids": ids, "attention_mask": mask}

    def stop_at_two(x):
        from transformers import StoppingCriteria, StoppingCriteriaList

        class AtTwo(StoppingCriteria):
            def __call__(self, input_ids, scores, **kw):
                return input_ids.shape[1] >= x._prompt_len + 2
        x._prompt_len = x.ids().shape[1]
        return {"stopping_criteria": StoppingCriteriaList([AtTwo()]), "max_new_tokens": 8}

    def redis_wrong_password(x):
        from kvtier.tiers.redis_server import LocalRedis

        server = LocalRedis(password="right-one")
        try:
            url = server.url.replace("right-one", SECRET)
            x.kvtier.RedisTier(x.layout(), 4, url, name="remote")
        finally:
            server.stop()

    c = [
        # offload / cache_for: the wrong things passed
        py("offload of a string", lambda x: x.kvtier.offload("gpt2").__enter__(), "model", value="str"),
        py("offload of a tokenizer", lambda x: x.kvtier.offload(x.tokenizer).__enter__(), "model"),
        py("offload of a config", lambda x: x.kvtier.offload(x.model.config).__enter__(), "model"),
        py("offload policy unknown", lambda x: x.offload_generate({"policy": "nope"}), "policy", value="nope"),
        py("offload hbm zero", lambda x: x.offload_generate({"hbm": 0}), "hbm", value="0"),
        py("offload hbm 1.5", lambda x: x.offload_generate({"hbm": 1.5}), "hbm", value="1.5"),
        py("offload hbm string", lambda x: x.offload_generate({"hbm": "0.2"}), "hbm", value="0.2"),
        py("offload hbm percent", lambda x: x.offload_generate({"hbm": 20}), "hbm", value="20"),
        py("offload tiers unknown", lambda x: x.offload_generate({"tiers": "nvme"}), "tiers", value="nvme"),
        py("offload unknown keyword", lambda x: x.offload_generate({"budget_tokens": 64}), "budget_tokens"),
        py("offload scope unknown", lambda x: x.offload_generate({"scope": "nearby"}), "scope", value="nearby"),
        py("offload page_size 24", lambda x: x.offload_generate({"page_size": 24}), "page_size", value="24"),
        py("offload kernel unknown", lambda x: x.offload_generate({"kernel": "cutlass"}), "kernel",
           value="cutlass"),
        py("offload topk option under resident", lambda x: x.offload_generate({"topk_pages": 4}), "topk_pages"),
        py("offload dense_layers 99", lambda x: x.offload_generate({"dense_layers": 99}), "dense_layers",
           value="99"),
        py("offload exact_prefill string", lambda x: x.offload_generate({"exact_prefill": "no"}), "exact_prefill",
           value="no"),
        py("offload fidelity string", lambda x: x.offload_generate({"fidelity": "yes"}), "fidelity", value="yes"),
        py("offload budget not a TokenBudget", lambda x: x.offload_generate({"budget": 64}), "budget", value="64"),
        py("offload default on a short prompt", lambda x: x.offload_generate({"hbm": 0.25},
                                                                             input_ids=x.ids(6)), "hbm"),
        py("offload nested", nested_offload, "model"),
        py("offload past_key_values given", lambda x: x.offload_generate(
            past_key_values=__import__("transformers").DynamicCache()), "past_key_values"),
        py("cache_for prompt_tokens zero", lambda x: cache_for(x, 0), "prompt_tokens", value="0"),
        py("cache_for prompt_tokens float", lambda x: cache_for(x, 100.5), "prompt_tokens", value="100.5"),
        py("cache_for new_tokens negative", lambda x: cache_for(x, 100, new_tokens=-1), "new_tokens", value="-1"),
        py("cache_for batch_size zero", lambda x: cache_for(x, 100, batch_size=0), "batch_size", value="0"),
        py("cache_for topk pages zero", lambda x: cache_for(x, 100, scope="topk", topk_pages=0, hbm=0.5),
           "topk_pages", value="0"),
        py("cache_for topk unknown option", lambda x: cache_for(x, 100, scope="topk", rankk="sketch"), "rankk"),
        py("cache_for of a non-model", lambda x: cache_for_raw(x, object(), 100), "model", value="object"),
        py("cache_for prompt longer than sized", lambda x: long_prompt_over_cache(x), "prompt"),
        # generate's own keywords through offload: the same tokens as HF (scope all), or HF's own error
        py("generate greedy", lambda x: x.same_as_hf()),
        py("generate max_new_tokens 0 (HF refuses it too)", lambda x: x.same_as_hf(max_new_tokens=0), "max_new_tokens",
           value="0"),
        py("generate max_new_tokens negative", lambda x: x.same_as_hf(max_new_tokens=-1), "max_new_tokens"),
        py("generate max_length only", lambda x: x.same_as_hf(max_new_tokens=None, max_length=x.ids().shape[1] + 3)),
        py("generate num_beams 2", lambda x: x.same_as_hf(num_beams=2)),
        py("generate num_beams 0", lambda x: x.same_as_hf(num_beams=0), "num_beams"),
        py("generate sampling, 2 sequences", lambda x: x.same_as_hf(seed=0, do_sample=True, num_return_sequences=2)),
        py("generate left-padded batch", lambda x: x.same_as_hf(**padded(x))),
        py("generate short padded batch at hbm 1", lambda x: x.same_as_hf(**padded(x, 40)), "hbm"),
        py("generate every token masked", lambda x: x.offload_generate(
            attention_mask=__import__("torch").zeros_like(x.ids(40)), input_ids=x.ids(40)), "input_ids"),
        py("generate empty prompt", lambda x: x.offload_generate(input_ids=x.ids()[:, :0]), "input_ids"),
        py("generate 1-D input_ids", lambda x: x.offload_generate(input_ids=x.ids()[0]), "input_ids"),
        py("generate list input_ids", lambda x: x.offload_generate(input_ids=x.ids()[0].tolist()), "input_ids"),
        py("generate unknown keyword", lambda x: x.same_as_hf(temprature=0.5), "temprature"),
        py("generate stopping criteria", lambda x: x.same_as_hf(**stop_at_two(x))),
        py("generate use_cache False", lambda x: x.offload_generate(use_cache=False), "use_cache"),
        py("generate return_dict_in_generate", lambda x: x.same_as_hf(return_dict_in_generate=True)),
        py("generate min_new_tokens over max", lambda x: x.same_as_hf(min_new_tokens=8, max_new_tokens=4)),
        # TieredKVCache and Engine
        py("TieredKVCache no tiers", lambda x: tkv(x, x.layout(), [], __import__("kvtier").LRU()), "tiers"),
        py("TieredKVCache policy a string", lambda x: tkv(x, x.layout(), [x.device()], "lru"), "policy",
           value="lru"),
        py("TieredKVCache layout a dict", lambda x: tkv(x, {"page_size": 4}, [x.device()],
                                                        __import__("kvtier").LRU()), "layout"),
        py("TieredKVCache unknown keyword", lambda x: tkv(x, page_budget=4), "page_budget"),
        py("TieredKVCache batch_size zero", lambda x: tkv(x, batch_size=0), "batch_size", value="0"),
        py("TieredKVCache host tier first", lambda x: tkv(x, x.layout(), [x.kvtier.HostTier(x.layout(), 8),
                                                                          x.device()], __import__("kvtier").LRU()),
           "tiers"),
        py("TieredKVCache tiers of another layout", lambda x: tkv(
            x, x.layout(), [x.device(layout=x.layout(head_dim=16))], __import__("kvtier").LRU()), "tiers"),
        py("TieredKVCache kernel unknown", lambda x: tkv(x, kernel="cutlass"), "kernel", value="cutlass"),
        py("Engine model a string", lambda x: engine(x, model="smollm2"), "model", value="str"),
        py("Engine policy None", lambda x: engine(x, policy=None), "policy"),
        py("Engine scope unknown", lambda x: engine(x, scope="nearby"), "scope", value="nearby"),
        py("Engine config a dict", lambda x: engine(x, config={"max_batch": 2}), "config"),
        py("EngineConfig max_batch zero", lambda x: x.kvtier.EngineConfig(max_batch=0), "engine.max_batch",
           value="0"),
        py("EngineConfig runner unknown", lambda x: x.kvtier.EngineConfig(runner="vllm"), "engine.runner",
           value="vllm"),
        py("EngineConfig buckets over max_batch", lambda x: x.kvtier.EngineConfig(buckets=[4]), "engine.buckets"),
        py("Engine.add empty prompt", lambda x: engine_add(x, x.ids()[0, :0]), "prompt"),
        py("Engine.add a list", lambda x: engine_add(x, x.ids()[0].tolist()), "prompt"),
        py("Engine.add too long for the tiers", lambda x: engine_add(x, x.ids()[0].repeat(20)), "prompt"),
        py("Engine layout not the model's", lambda x: x.kvtier.Engine(x.model, x.layout(), [x.device()],
                                                                      __import__("kvtier").LRU()), "layout"),
        # other public calls
        py("load_model path missing", lambda x: x.kvtier.load_model("/nonexistent/model"), "model.path"),
        py("load_model dtype", lambda x: x.kvtier.load_model(dtype="float8"), "model.dtype", value="float8"),
        py("load_model device", lambda x: x.kvtier.load_model(device="tpu"), "model.device", value="tpu"),
        py("kv_layout_for page_size zero", lambda x: x.kvtier.kv_layout_for(x.model.config, page_size=0),
           "page_size", value="0"),
        py("kv_layout_for of a model", lambda x: x.kvtier.kv_layout_for(x.model), "config"),
        py("TokenBudget sinks over tokens", lambda x: x.kvtier.TokenBudget(16, sinks=32, window=4, page_size=4),
           "sinks"),
        py("HostTier capacity a string", lambda x: x.kvtier.HostTier(x.layout(), "4"), "capacity", value="4"),
        py("DeviceTier on cuda without a GPU", lambda x: x.kvtier.DeviceTier(x.layout(), 4, device="cuda:3"),
           "device", value="cuda:3"),
        py("DiskTier under /proc", lambda x: x.kvtier.DiskTier(x.layout(), 4, "/proc/kvtier"), "path",
           value="/proc/kvtier"),
        py("RedisTier password, nothing answers", lambda x: x.kvtier.RedisTier(
            x.layout(), 4, f"redis://user:{SECRET}@127.0.0.1:1/0", name="remote"), "url"),
        py("RedisTier wrong password", redis_wrong_password, "url"),
        py("RedisTier url of another scheme", lambda x: x.kvtier.RedisTier(x.layout(), 4, f"http://u:{SECRET}@x/",
                                                                           name="remote"), "url"),
        py("example python_api --tokens 128", lambda x: run_example(x, "--tokens", "128"), "--tokens"),
        py("example python_api --tokens -1", lambda x: run_example(x, "--tokens", "-1"), "--tokens", value="-1"),
    ]
    return c


def nested_offload(x):
    with x.kvtier.offload(x.model), x.kvtier.offload(x.model):
        pass


def cache_for_raw(x, model, n):
    return x.kvtier.cache_for(model, n)


def long_prompt_over_cache(x):
    ids = x.ids(160)
    with x.kvtier.cache_for(x.model, 64, new_tokens=4, hbm=1.0) as cache:
        x.model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False)


def run_example(x, *args):
    """examples/python_api.py in a fresh interpreter: its one error line, raised as the error it names."""
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "python_api.py"), *args], capture_output=True,
                          text=True, timeout=600, cwd=x.tmp, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode == 0:
        return None
    if "Traceback" in proc.stderr:
        raise RuntimeError(proc.stderr.strip().splitlines()[-1])
    from kvtier.errors import KVTierError

    raise KVTierError(proc.stderr.strip())


# -- running and classing ---------------------------------------------------------------------------------------
FLAGS = {"-m": 0, "--multirun": 0, "-cn": 1, "--config-name": 1, "-cd": 1, "--config-dir": 1}  # -> values taken


def argv_of(case: Case, tmp: Path) -> list[str]:
    """Hydra's flags, then :data:`BASE` less what the case sets (a key, its budget, another task's keys), then the
    case's overrides."""
    args, flags, i = [a.replace("{tmp}", str(tmp)) for a in case.cli], [], 0
    while i < len(args):
        if args[i] in FLAGS:
            n = FLAGS[args[i]] + 1
            flags += args[i:i + n]
            del args[i:i + n]
        else:
            i += 1
    keys = {a.lstrip("+~").partition("=")[0] for a in args if "=" in a}

    def dropped(line: str) -> bool:
        key = line.partition("=")[0]
        return key in keys or (key.startswith("budget.") and any(k.startswith("budget.") for k in keys)) or \
            (key.startswith("task.") and "task" in keys)
    return flags + ([b for b in BASE if not dropped(b)] if case.base else []) + args


def run_cli(argv: list[str], cwd: Path) -> dict:
    """``kvtier-run argv`` in this process from ``cwd``: exit code, everything printed, whether the model had
    loaded, the metrics written."""
    import kvtier.run as run

    loaded = []
    build_model = run.build_model

    def watched(cfg):
        result = build_model(cfg)
        loaded.append(True)
        return result
    run.build_model = watched
    out, before, code = io.StringIO(), os.getcwd(), 0
    argv_before = sys.argv
    os.chdir(cwd)
    sys.argv = ["kvtier-run", *argv]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            run.main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - what escapes main is a traceback for the user
        code = "raised"
        out.write(traceback.format_exc())
    finally:
        run.build_model, sys.argv = build_model, argv_before
        os.chdir(before)
    if code in (128 + signal.SIGTERM, 128 + signal.SIGINT):  # the sweep itself was stopped (main turns it into an exit)
        raise SystemExit(code)
    metrics = [json.loads(p.read_text()) for p in sorted(cwd.rglob("metrics.json"))]
    return {"code": code, "text": out.getvalue(), "loaded": bool(loaded), "metrics": metrics}


def run_cli_isolated(argv: list[str], cwd: Path) -> dict:
    """:func:`run_cli` in a fresh interpreter."""
    result = cwd / ".front_sweep_result.json"
    code = "import json, sys; from bench.front_sweep import run_cli; from pathlib import Path; " \
           "r = run_cli(sys.argv[2:], Path(sys.argv[1])); Path(sys.argv[1], '.front_sweep_result.json')" \
           ".write_text(json.dumps(r, default=str))"
    proc = subprocess.run([sys.executable, "-c", code, str(cwd), *argv], capture_output=True, text=True,
                          timeout=900, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if not result.is_file():
        return {"code": "raised", "text": proc.stdout + proc.stderr, "loaded": False, "metrics": []}
    return json.loads(result.read_text())


def named_in(case: Case, message: str) -> str | None:
    """Why ``message`` does not name the case's key and value, or None."""
    parent, _, leaf = case.key.rpartition(".")
    if case.key not in message and f"{parent}: has no key '{leaf}'" not in message:
        return f"does not name {case.key}"
    if case.value is not None and case.value not in message:
        return f"does not name the value {case.value}"
    return None


def classify_cli(case: Case, r: dict) -> tuple[str, str]:
    text = r["text"]
    if SECRET in text:
        return "secret", text.strip().splitlines()[-1] if text.strip() else ""
    if r["code"] == 0:
        if case.key is not None:
            return "silent", "ran to the end"
        why = case.check(r["metrics"][-1]) if case.check and r["metrics"] else None
        if not r["metrics"]:
            why = "no metrics.json"
        return ("silent", why) if why else ("ok", "ran")
    lines = [line for line in text.splitlines() if line.startswith("kvtier-run:")]
    if r["code"] == "raised" or "Traceback" in text or "Error executing job" in text or len(lines) != 1:
        tail = [line for line in text.strip().splitlines() if line.strip() and "HYDRA_FULL_ERROR" not in line]
        return "traceback", tail[-1] if tail else f"exit {r['code']}"
    message = lines[0]
    if case.key is None:
        return "refused", message
    if r["loaded"] and not case.after_load:
        return "late", message
    why = named_in(case, message)
    return ("wrong_key", f"{message} [{why}]") if why else ("named", message)


def run_python(case: Case, ctx: Ctx) -> tuple[str, str]:
    from kvtier.errors import KVTierError

    try:
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            result = case.call(ctx)
    except (KVTierError, HFError) as e:
        message = str(e).strip()
        if SECRET in message or SECRET in printed.getvalue():
            return "secret", message
        if len(message.splitlines()) != 1:
            return "traceback", f"{type(e).__name__}: {message.splitlines()[-1]}"
        if case.key is None:
            return "refused", f"{type(e).__name__}: {message}"
        why = named_in(case, message)
        return ("wrong_key", f"{type(e).__name__}: {message} [{why}]") if why else \
            ("named", f"{type(e).__name__}: {message}")
    except Exception as e:  # noqa: BLE001
        where = traceback.extract_tb(e.__traceback__)[-1]
        message = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''} " \
                  f"({Path(where.filename).name}:{where.lineno})"
        return ("secret" if SECRET in message else "traceback"), message
    if case.key is not None:
        return "silent", f"accepted (returned {type(result).__name__})"
    return ("silent", result) if isinstance(result, str) else ("ok", "as HF" if case.name.startswith("generate")
                                                                else "ran")


def cases() -> list[Case]:
    return cli_cases() + file_cases() + python_cases()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="run the cases whose name holds this")
    p.add_argument("--door", choices=["cli", "file", "python"], help="run one door's cases")
    p.add_argument("--isolate", action="store_true", help="each kvtier-run case in a fresh interpreter")
    p.add_argument("--out", default=str(OUT), help="writes OUT.json and OUT.md")
    args = p.parse_args()
    os.environ.setdefault("WANDB_MODE", "disabled")
    chosen = [c for c in cases() if args.only in c.name and (args.door is None or c.door == args.door)]
    rows, root = [], Path(tempfile.mkdtemp(prefix="kvtier-front-sweep-"))
    ctx = Ctx(root)
    for i, case in enumerate(chosen):
        tmp = root / f"case{i:03d}"
        tmp.mkdir()
        if case.setup:
            case.setup(tmp)
        t0 = time.perf_counter()
        if case.cli is not None:
            argv = argv_of(case, tmp)
            outcome, message = classify_cli(case, (run_cli_isolated if args.isolate else run_cli)(argv, tmp))
            given = "kvtier-run " + " ".join(a for a in argv if a not in BASE)
        else:
            ctx.tmp = tmp
            outcome, message = run_python(case, ctx)
            given = case.name
        seconds = time.perf_counter() - t0
        rows.append({"name": case.name, "door": case.door, "input": given, "key": case.key, "outcome": outcome,
                     "message": message, "seconds": round(seconds, 2)})
        print(f"[{i + 1}/{len(chosen)}] {outcome:9s} {seconds:6.1f}s  {case.name}: {message[:200]}", flush=True)
    counts = {k: sum(r["outcome"] == k for r in rows) for k in CLASSES}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    summary = {"commit": commit, "cases": len(rows), "counts": counts, "isolate": args.isolate, "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1, default=str))
    table = ["| door | case | input | outcome | message | s |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        cells = [r["door"], r["name"], f"`{r['input']}`", r["outcome"], r["message"].replace("|", "\\|"),
                 f"{r['seconds']:.1f}"]
        table.append("| " + " | ".join(c.replace("\n", " ") for c in cells) + " |")
    head = f"# Front-end sweep ({len(rows)} inputs, commit {commit})\n\n`python -m bench.front_sweep" \
           f"{' --isolate' if args.isolate else ''}`\n\n" + \
           " | ".join(f"{k}: {v}" for k, v in counts.items()) + "\n\n"
    out.with_suffix(".md").write_text(head + "\n".join(table) + "\n")
    print(json.dumps(counts))


if __name__ == "__main__":
    main()
