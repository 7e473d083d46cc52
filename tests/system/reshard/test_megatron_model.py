"""The mapping against the real thing: HF Qwen2/Llama weights mapped by
:mod:`system.reshard.megatron` into a real megatron-core ``GPTModel`` (local spec) give the HF
model's logits, at tp=1 and at tp=2 (two gloo processes).

megatron-core has no CPU mode; the few CUDA-only call sites met by building the model and one
forward pass are redirected to the CPU by :func:`_on_cpu` here (the engine has its own, fuller
compatibility module; this test wants only the forward pass and imports no engine).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import pytest
import torch

from system.reshard.megatron import hf_to_megatron_shard, padded_vocab
from system.reshard.params import ModelShape
from tests.helpers import end_rank, rank_context

pytest.importorskip("megatron.core")


def _cpu_device(d: Any) -> Any:
    if isinstance(d, torch.device) and d.type == "cuda":
        return torch.device("cpu")
    if isinstance(d, str) and d.startswith("cuda"):
        return "cpu"
    if isinstance(d, int) and not isinstance(d, bool):  # torch.cuda.current_device() index
        return "cpu"
    return d


class _CudaToCpu(torch.overrides.TorchFunctionMode):
    """Device arguments that name CUDA become the CPU; ``Tensor.cuda()`` is the identity."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        if func is torch.Tensor.to and len(args) > 1 and not isinstance(args[1], torch.dtype):
            args = (args[0], _cpu_device(args[1]), *args[2:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def _on_cpu() -> Iterator[None]:
    orig = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    try:
        with _CudaToCpu():
            yield
    finally:
        torch.cuda.current_device = orig  # type: ignore[assignment]


def _hf_model(kind: str, tied: bool) -> Any:
    import transformers

    common = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=tied)
    cfg = (transformers.Qwen2Config(**common) if kind == "qwen2"
           else transformers.LlamaConfig(**common, attention_bias=False, mlp_bias=False))
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = (transformers.Qwen2ForCausalLM if kind == "qwen2"
             else transformers.LlamaForCausalLM)(cfg).eval()
    with torch.no_grad():  # make norms and biases non-trivial so a misplacement shows
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or n.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _rank(rank: int, tp: int, store: str, kind: str, tied: bool, out: Any) -> None:
    try:
        out.put((rank, _rank_body(rank, tp, store, kind, tied)))
    except Exception as e:  # report, do not hang the parent
        out.put((rank, f"{type(e).__name__}: {e}"))
        return
    end_rank()


def _rank_body(rank: int, tp: int, store: str, kind: str, tied: bool) -> Any:
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    torch.set_num_threads(1)
    hf = _hf_model(kind, tied)
    shape = ModelShape.from_hf(hf.config)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=tp)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    cfg = TransformerConfig(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.intermediate_size, num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads, kv_channels=shape.head_dim,
        tensor_model_parallel_size=tp, normalization="RMSNorm", layernorm_epsilon=1e-6,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, gradient_accumulation_fusion=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False)
    with _on_cpu():
        tensor_parallel.model_parallel_cuda_manual_seed(0, inference_rng_tracker=True)
        model = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=padded_vocab(96, tp),
                         max_sequence_length=64, position_embedding_type="rope",
                         rotary_base=10000, share_embeddings_and_output_weights=tied,
                         parallel_output=False).eval()
    shard = hf_to_megatron_shard(dict(hf.state_dict()), shape, tp, rank, 1, 0)
    missing, unexpected = model.load_state_dict(shard, strict=False)
    assert not unexpected, unexpected
    assert all(k.endswith("._extra_state") for k in missing), missing
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(12).unsqueeze(0).expand(2, -1)
    with torch.no_grad(), _on_cpu():
        got = model(ids, pos, attention_mask=None)[..., :96]
    with torch.no_grad():
        want = hf(ids).logits
    return (got - want).abs().max().item()


@pytest.mark.parametrize("kind,tied,tp", [("qwen2", False, 1), ("llama", True, 1),
                                          ("qwen2", True, 2)])
def test_megatron_gpt_model_gives_the_hf_logits(kind: str, tied: bool, tp: int, tmp_path):
    ctx = rank_context()
    out = ctx.Queue()
    store = str(tmp_path / "store")
    procs = [ctx.Process(target=_rank, args=(r, tp, store, kind, tied, out)) for r in range(tp)]
    for p in procs:
        p.start()
    try:
        results = dict(out.get(timeout=240) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for rank, diff in sorted(results.items()):
        print(f"tp={tp} rank {rank}: max |megatron - HF| logits {diff}")
        assert isinstance(diff, float), f"rank {rank}: {diff}"
        # tp=1 computes in HF's order (0.0 seen); tp=2 sums the row-parallel halves apart
        assert diff == 0.0 if tp == 1 else diff < 1e-5, \
            f"rank {rank}: megatron logits differ from HF by {diff}"


