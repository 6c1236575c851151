"""The vocabulary Megatron's tokenizer gives a command line, read offline from the tokenizer's files.

Megatron sizes the embedding and the output layer from the tokenizer it builds (megatron-core 0.19.2,
``core/tokenizers/utils/build_tokenizer.py``): ``len(tokenizer)`` for HuggingFaceTokenizer and GPT2BPETokenizer
(the model vocabulary and the added tokens), ``--vocab-size`` for NullTokenizer, ``--vocab-size`` or 2**17 for
TikTokenizer; ``--padded-vocab-size``, where given, wins. The vocabulary term of the plan grows with it, so a
tokenizer whose vocabulary the planner cannot read is an error naming ``--vocab-size``, never a guess.

Only local files are read (a tokenizer directory or file, or the Hugging Face cache): never the network.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..config_base import PeakflatConfigError

__all__ = ["tokenizer_vocab", "vocab_from_flags", "GPT2_VOCAB", "TIKTOKEN_DEFAULT_VOCAB"]

GPT2_VOCAB = 50257
"""GPT-2's vocab.json, which GPT2BPETokenizer downloads where no --vocab-file is given (Megatron's default
tokenizer in pretrain_gpt.py)."""
TIKTOKEN_DEFAULT_VOCAB = 2**17
"""TikTokenizer's vocabulary without --vocab-size (DEFAULT_TIKTOKEN_MAX_VOCAB)."""


def _distinct(vocab: Any, added: list[Any]) -> int:
    """Tokens of a model vocabulary (a dict of token -> id, or Unigram's list of [piece, score]) and the added
    tokens, each counted once, as ``len(tokenizer)`` counts them."""
    tokens = set(vocab) if isinstance(vocab, dict) else {p[0] if isinstance(p, (list, tuple)) else p for p in vocab}
    tokens |= {t["content"] if isinstance(t, dict) else t for t in added}
    return len(tokens)


def _read_tokenizer_json(path: Path) -> int:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return _distinct(data["model"]["vocab"], data.get("added_tokens") or [])


def _read_vocab_json(path: Path, added: Path | None = None) -> int:
    with open(path, encoding="utf-8") as f:
        vocab = json.load(f)
    extra: list[Any] = []
    if added is not None and added.is_file():
        with open(added, encoding="utf-8") as f:
            extra = list(json.load(f))
    return _distinct(vocab, extra)


def _hf_cache_dirs(name: str) -> list[Path]:
    """The snapshots of ``org/name`` in the local Hugging Face cache (HF_HUB_CACHE, HF_HOME/hub or ~/.cache)."""
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface"), "hub")
    snaps = Path(hub) / ("models--" + name.replace("/", "--")) / "snapshots"
    return sorted(snaps.iterdir()) if snaps.is_dir() else []


def _hf_vocab(model: str | None, vocab_file: str | None) -> int | None:
    """``len(tokenizer)`` of a Hugging Face tokenizer from its local files, or None where none is readable."""
    candidates: list[Path] = []
    if model:
        p = Path(model).expanduser()
        candidates += [p] if p.is_file() else ([p] if p.is_dir() else []) + _hf_cache_dirs(model)
    for place in candidates:
        try:
            if place.is_file():
                return _read_tokenizer_json(place) if place.suffix == ".json" and place.name != "vocab.json" \
                    else _read_vocab_json(place)
            if (place / "tokenizer.json").is_file():
                return _read_tokenizer_json(place / "tokenizer.json")
            if (place / "vocab.json").is_file():
                return _read_vocab_json(place / "vocab.json", place / "added_tokens.json")
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            continue
    if vocab_file:
        try:
            return _read_vocab_json(Path(vocab_file).expanduser())
        except (OSError, ValueError, TypeError):
            return None
    return None


def tokenizer_vocab(ns: Any) -> tuple[int | None, str | None]:
    """(the unpadded vocabulary of the tokenizer the flags in ``ns`` name, None where unknown; why it is unknown).

    No --tokenizer-type: GPT-2's (Megatron's pretraining default), from --vocab-file where given. A tokenizer
    whose files are not readable here gives (None, the reason), for the caller to take --vocab-size, a preset's
    vocabulary, or to refuse (``vocab_from_flags``)."""
    kind = getattr(ns, "tokenizer_type", None)
    given = getattr(ns, "vocab_size", None)
    vocab_file = getattr(ns, "vocab_file", None)
    if kind in (None, "GPT2BPETokenizer"):
        if not vocab_file:
            return (GPT2_VOCAB if kind else None), None
        try:
            return _read_vocab_json(Path(vocab_file).expanduser()), None
        except (OSError, ValueError, TypeError) as e:
            return None, f"its --vocab-file {vocab_file} is not readable here ({type(e).__name__})"
    if kind in ("NullTokenizer", "NullMultimodalTokenizer"):
        return given, (None if given else f"{kind} takes its vocabulary from --vocab-size, which is not given")
    if kind == "TikTokenizer":
        return given or TIKTOKEN_DEFAULT_VOCAB, None
    if kind == "HuggingFaceTokenizer":
        found = _hf_vocab(getattr(ns, "tokenizer_model", None), vocab_file)
        if found is not None:
            return found, None
        return None, (f"no tokenizer.json or vocab.json is readable at --tokenizer-model "
                      f"{getattr(ns, 'tokenizer_model', None)} (nor in the local Hugging Face cache), and the "
                      "planner never downloads one")
    return None, f"the planner does not read {kind}'s vocabulary"


def vocab_from_flags(ns: Any, base_vocab: int | None) -> tuple[int, str]:
    """The vocabulary to plan, and where it came from: --padded-vocab-size; else the tokenizer's (read offline);
    else --vocab-size; else ``base_vocab`` (a preset's); else GPT-2's where no tokenizer is named. Raises
    PeakflatConfigError, naming --vocab-size, where the line names a tokenizer whose vocabulary is unknown."""
    padded = getattr(ns, "padded_vocab_size", None)
    if padded is not None:
        return padded, "--padded-vocab-size"
    read, why = tokenizer_vocab(ns)
    if read is not None:
        return read, f"the tokenizer ({getattr(ns, 'tokenizer_type', None) or 'GPT2BPETokenizer'})"
    given = getattr(ns, "vocab_size", None)
    if given is not None:
        return given, "--vocab-size"
    if base_vocab is not None:
        return base_vocab, "the preset"
    if why is None:
        return GPT2_VOCAB, "GPT-2's vocabulary (Megatron's default tokenizer, GPT2BPETokenizer)"
    kind = getattr(ns, "tokenizer_type", None)
    raise PeakflatConfigError("--tokenizer-type", kind, f"sets the vocabulary, and {why}",
                              "pass --vocab-size N with the tokenizer's vocabulary (len(tokenizer) for a Hugging "
                              "Face tokenizer; Megatron ignores it for that tokenizer and pads it as it pads the "
                              "tokenizer's), or --padded-vocab-size")
