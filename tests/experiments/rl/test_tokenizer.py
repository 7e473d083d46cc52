"""The direct tokenizer load (no torch) gives what ``AutoTokenizer`` gives, for every entry of
:data:`experiments.rl.tokenizer.DIRECT`; anything it does not know goes through
``AutoTokenizer``. A transformers release that changes its choice fails here."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from experiments.rl.tokenizer import DIRECT, direct_class, load_tokenizer
from system.paths import PROJECT_ROOT

BASES = {"llama": "smollm2-135m-instruct", "qwen2": "arith-tiny", "qwen3": "arith-tiny",
         "mistral": "smollm2-135m-instruct"}
TEXTS = ["12+30=", "  7 * 8 = 56\n", "<s>what is 3-4?</s>", ""]


def _model_dir(tmp_path, model_type: str, tokenizer_class: str, **extra) -> str:
    base = os.path.join(PROJECT_ROOT, ".models", BASES[model_type])
    if not os.path.isfile(os.path.join(base, "tokenizer.json")):
        pytest.skip("the models are created by scripts/setup.sh")
    d = tmp_path / f"{model_type}-{tokenizer_class}"
    shutil.copytree(base, d, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((d / "config.json").read_text())
    config["model_type"] = model_type
    (d / "config.json").write_text(json.dumps(config))
    tok_config = json.loads((d / "tokenizer_config.json").read_text())
    tok_config.update(tokenizer_class=tokenizer_class, **extra)
    (d / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return str(d)


def _same(a, b) -> None:
    assert type(a) is type(b)
    assert (a.bos_token_id, a.eos_token_id, a.pad_token_id, len(a)) == \
        (b.bos_token_id, b.eos_token_id, b.pad_token_id, len(b))
    for text in TEXTS:
        assert a.encode(text, add_special_tokens=False) == b.encode(text,
                                                                     add_special_tokens=False)
        ids = b.encode(text)
        assert a.decode(ids) == b.decode(ids)
    assert a.chat_template == b.chat_template
    if b.chat_template:
        chat = [{"role": "user", "content": TEXTS[0]}]
        assert a.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
            b.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)


CASES = [(t, c) for t, classes in DIRECT.items() for c in sorted(classes)]


@pytest.mark.parametrize("model_type, tokenizer_class", CASES)
def test_the_direct_class_is_what_auto_tokenizer_picks(model_type, tokenizer_class, tmp_path):
    from transformers import AutoTokenizer

    path = _model_dir(tmp_path, model_type, tokenizer_class)
    assert direct_class(path) == DIRECT[model_type][tokenizer_class]
    _same(load_tokenizer(path), AutoTokenizer.from_pretrained(path, local_files_only=True))


@pytest.mark.parametrize("model_type, tokenizer_class, extra", [
    ("llama", "LlamaTokenizer", {}),  # a class of its own: AutoTokenizer decides
    ("mistral", "TokenizersBackend", {}),  # a family DIRECT does not know
    ("qwen2", "TokenizersBackend", {"auto_map": {"AutoTokenizer": [None, "tok.Tok"]}}),
])
def test_anything_else_goes_through_auto_tokenizer(model_type, tokenizer_class, extra, tmp_path):
    from transformers import AutoTokenizer

    path = _model_dir(tmp_path, model_type, tokenizer_class, **extra)
    assert direct_class(path) is None
    if "auto_map" not in extra:  # (remote code is not trusted: no load to compare)
        _same(load_tokenizer(path), AutoTokenizer.from_pretrained(path, local_files_only=True))


def test_a_direct_load_imports_no_torch():
    base = os.path.join(PROJECT_ROOT, ".models", "arith-tiny")
    if not os.path.isfile(os.path.join(base, "tokenizer.json")):
        pytest.skip("the models are created by scripts/setup.sh")
    code = ("import sys; from experiments.rl.tokenizer import load_tokenizer; "
            f"t = load_tokenizer({base!r}); "
            "print(type(t).__name__, 'torch' in sys.modules, "
            "'transformers.models.auto.tokenization_auto' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=PROJECT_ROOT, check=True).stdout.split()
    assert out == ["Qwen2Tokenizer", "False", "False"]


def test_a_release_without_the_class_module_falls_back_to_auto_tokenizer(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from experiments.rl import tokenizer

    def missing() -> type:
        raise ImportError("no module named transformers.tokenization_utils_tokenizers")

    path = _model_dir(tmp_path, "llama", "TokenizersBackend")
    monkeypatch.setitem(tokenizer.DIRECT, "llama", {"TokenizersBackend": missing})
    assert direct_class(path) is missing
    _same(load_tokenizer(path), AutoTokenizer.from_pretrained(path, local_files_only=True))
