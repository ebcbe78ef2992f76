"""The tiny random-weight Llama and word-level ChatML tokenizer the real-vLLM tests and runs serve.

Built locally with ``transformers`` and ``tokenizers`` (vLLM's own dependencies; no model hub, HF_HUB_OFFLINE=1),
seeded, and written once to a cache directory (``$KVGATE_MODEL_DIR``, else ``~/.cache/kvgate/tiny-llama``) that
every later call reuses: ``kvgate-model.json`` in it records the spec's fingerprint, and a directory whose
fingerprint differs is rebuilt. Building takes a few seconds; the weights are ~35 MB.

The model (:class:`ModelSpec`): Llama, 2 layers, hidden 256, 4 attention heads of 64 (4 KV heads), MLP 512,
vocabulary 32,000, bf16 weights (vLLM's CPU backend runs bf16 natively on AVX-512 machines). Random weights: the
text it writes is noise, which is all the cache and scheduler need. KV bytes per token =
2 (K and V) x layers x KV heads x head dim x 2 bytes = 2,048 (:func:`kv_bytes_per_token`).

The tokenizer: word level. Text is split into ``\\w+`` runs and runs of other non-space symbols (whitespace is
dropped); each piece is one token if it is in the vocabulary, else ``<unk>``. The vocabulary holds the ChatML
special tokens, punctuation, the numbers 0-9999, the words ``kvgate drive`` writes and the chat roles, padded with
``w00000``-style words to 32,000. Decoding joins tokens with single spaces, so decoded output re-tokenizes to the
same ids (what the driver relies on in chat mode). Chat template: ChatML, as Qwen's without tools::

    <|im_start|>{role}\\n{content}<|im_end|>\\n ... [<|im_start|>assistant\\n]

``<|im_end|>`` is the end-of-sequence token.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import string
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvgate.errors import UsageError

ENV_MODEL_DIR = "KVGATE_MODEL_DIR"
DEFAULT_MODEL_DIR = Path("~/.cache/kvgate/tiny-llama")
MARKER = "kvgate-model.json"
FORMAT = 1
"""Bumped when the build changes in a way the spec does not show (the tokenizer, the template)."""

SPECIAL_TOKENS = ("<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- elif message['content'] -%}"
    "{%- for part in message['content'] -%}{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class ModelSpec:
    """The tiny model's shape. The defaults are what the tests and ``kvgate real-vllm`` serve."""

    layers: int = 2
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 4
    intermediate: int = 512
    vocab: int = 32_000
    dtype: str = "bfloat16"
    max_positions: int = 65_536
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def kv_bytes_per_token(self) -> int:
        """Bytes of KV cache one token takes over all layers (K and V)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * _DTYPE_BYTES[self.dtype]

    def fingerprint(self) -> str:
        text = json.dumps({"format": FORMAT, **asdict(self), "vocab_words": vocabulary(self.vocab)}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


DEFAULT_SPEC = ModelSpec()


def model_dir(path: str | Path | None = None) -> Path:
    """Where the model lives: ``path``, else ``$KVGATE_MODEL_DIR``, else ``~/.cache/kvgate/tiny-llama``."""
    if path is None:
        path = os.environ.get(ENV_MODEL_DIR) or DEFAULT_MODEL_DIR
    return Path(path).expanduser()


def prepared_model(path: str | Path | None = None) -> Path:
    """The model a real engine serves: a directory of the user's own (a ``config.json`` not built by kvgate) as it
    is, else kvgate's tiny model, built there if missing."""
    where = model_dir(path)
    if (where / "config.json").exists() and not (where / MARKER).exists():
        return where
    return build_model(where)


def vocabulary(size: int) -> list[str]:
    """The tokenizer's vocabulary in id order (special tokens first)."""
    from kvgate.drive.prompts import WORDS  # the driver's prompt words

    words: list[str] = list(SPECIAL_TOKENS)
    seen = set(words)

    def add(w: str) -> None:
        if w not in seen:
            seen.add(w)
            words.append(w)

    for w in ("system", "user", "assistant", "tool", *WORDS, *string.ascii_letters):
        add(w)
    for c in string.punctuation:
        add(c)
    for i in range(10_000):
        add(str(i))
    i = 0
    while len(words) < size:
        add(f"w{i:05d}")
        i += 1
    if len(words) > size:
        raise ValueError(f"a vocabulary of {size} is too small for the fixed words ({len(words)})")
    return words


def is_built(path: str | Path | None = None, spec: ModelSpec = DEFAULT_SPEC) -> bool:
    """Whether ``path`` holds a complete build of ``spec``."""
    marker = model_dir(path) / MARKER
    try:
        return bool(json.loads(marker.read_text()).get("fingerprint") == spec.fingerprint())
    except (OSError, ValueError):
        return False


def kv_bytes_per_token(path: str | Path | None = None) -> int:
    """KV bytes per token of the model in ``path`` (from its ``config.json``; bf16/fp16/fp32 KV cache)."""
    cfg = json.loads((model_dir(path) / "config.json").read_text())
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16")
    return 2 * int(cfg["num_hidden_layers"]) * kv_heads * head_dim * _DTYPE_BYTES[dtype]


def _require_builders() -> tuple[Any, Any, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import tokenizers
        import torch
        import transformers
    except ImportError as e:
        raise UsageError(
            f"building the tiny model needs torch, transformers and tokenizers ({e.name} is missing); "
            "install the real vLLM with .ci/install-vllm.sh"
        ) from None
    return torch, transformers, tokenizers


def build_model(path: str | Path | None = None, spec: ModelSpec = DEFAULT_SPEC, *, force: bool = False) -> Path:
    """Build the model and tokenizer into ``path`` unless a build of ``spec`` is already there; return the path.

    The build goes to a temporary sibling directory first and is moved into place whole, under a lock file, so
    concurrent callers (two test processes) never see a half-written model."""
    out = model_dir(path)
    if not force and is_built(out, spec):
        return out
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / MARKER).exists())):
        raise UsageError(f"{out} exists and is not a kvgate model build; choose another model directory")
    torch, transformers, tokenizers = _require_builders()
    out.parent.mkdir(parents=True, exist_ok=True)
    import fcntl

    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not force and is_built(out, spec):
            return out
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        tmp.chmod(0o755)
        try:
            _write(tmp, spec, torch, transformers, tokenizers)
            if out.exists():
                shutil.rmtree(out)
            tmp.rename(out)
        finally:
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(tmp)
    return out


def _write(out: Path, spec: ModelSpec, torch: Any, transformers: Any, tokenizers: Any) -> None:
    from tokenizers import models, pre_tokenizers

    words = vocabulary(spec.vocab)
    ids = {w: i for i, w in enumerate(words)}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab=ids, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        model_max_length=spec.max_positions,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)

    eos = ids["<|im_end|>"]
    cfg = transformers.LlamaConfig(
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_positions,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(spec.seed)
    model = transformers.LlamaForCausalLM(cfg).to(getattr(torch, spec.dtype))
    model.save_pretrained(out)
    transformers.GenerationConfig(eos_token_id=eos, pad_token_id=cfg.pad_token_id).save_pretrained(out)
    (out / MARKER).write_text(
        json.dumps(
            {"fingerprint": spec.fingerprint(), "spec": asdict(spec), "kv_bytes_per_token": spec.kv_bytes_per_token()},
            indent=1,
        )
        + "\n"
    )
