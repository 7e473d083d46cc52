"""Loading a model directory's tokenizer, as ``AutoTokenizer`` would, without importing torch.

``transformers.AutoTokenizer`` imports its configuration and generation machinery, and with it
torch: 4.5 CPU-s of every master's and rollout worker's start on two cores, for workers that
never touch a tensor. The class ``AutoTokenizer`` picks depends only on the directory's
``tokenizer_config.json`` and ``config.json``; for the model families this project trains
(Llama, Qwen2, Qwen3, saved by transformers 5), :data:`DIRECT` names that class, and it is
imported and loaded directly (about 1 CPU-s). Anything else (other families, remote code, other
declared classes) goes through ``AutoTokenizer`` itself. ``tests/experiments/rl/test_tokenizer.py``
checks each entry against ``AutoTokenizer``: same class, same ids, same chat template."""
from __future__ import annotations

import json
import os
from typing import Any, Callable


def _tokenizers_backend() -> type:
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    return TokenizersBackend


def _qwen2_tokenizer() -> type:
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    return Qwen2Tokenizer


_GENERIC = ("TokenizersBackend", "PreTrainedTokenizerFast")  # (the latter: the former's old name)
_QWEN2_NAMED = ("Qwen2Tokenizer", "Qwen2TokenizerFast")

DIRECT: dict[str, dict[str, Callable[[], type]]] = {
    # Llama: transformers registers no tokenizer for the type: the declared class is used
    "llama": dict.fromkeys(_GENERIC, _tokenizers_backend),
    # Qwen2: the type's registered class wins over a generic declared one
    "qwen2": dict.fromkeys(_GENERIC + _QWEN2_NAMED, _qwen2_tokenizer),
    # Qwen3: the declared class is used
    "qwen3": {**dict.fromkeys(_GENERIC, _tokenizers_backend),
              **dict.fromkeys(_QWEN2_NAMED, _qwen2_tokenizer)},
}
"""``config.json``'s ``model_type`` -> ``tokenizer_config.json``'s ``tokenizer_class`` -> what
imports and returns the class ``AutoTokenizer`` picks for them."""


def _json(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def direct_class(path: str) -> Callable[[], type] | None:
    """What imports the class that ``AutoTokenizer.from_pretrained(path)`` returns, where
    :data:`DIRECT` knows it for sure; ``None`` where only ``AutoTokenizer`` can tell."""
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        return None
    tok_config = _json(os.path.join(path, "tokenizer_config.json"))
    config = _json(os.path.join(path, "config.json"))
    if tok_config is None or config is None or "auto_map" in tok_config:
        return None
    return DIRECT.get(str(config.get("model_type")), {}).get(
        str(tok_config.get("tokenizer_class")))


def load_tokenizer(path: str) -> Any:
    """The tokenizer of the local model directory ``path``, of the class ``AutoTokenizer``
    picks."""
    known = direct_class(path)
    try:
        cls = None if known is None else known()
    except ImportError:  # a transformers release without that module: AutoTokenizer decides
        cls = None
    if cls is None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    return cls.from_pretrained(path, local_files_only=True)


__all__ = ["DIRECT", "direct_class", "load_tokenizer"]
