"""The model against Hugging Face transformers' LlamaForCausalLM, and the flavour sizes."""

import pytest
import torch

from titan_pipe.model.args import FLAVOURS, count_params, flops_per_token, resolve_args
from titan_pipe.model.names import hf_to_native, native_to_hf
from titan_pipe.model.hf_config import from_hf_config, to_hf_config
from titan_pipe.model.transformer import build_model

transformers = pytest.importorskip("transformers")

PUBLISHED = {  # parameter counts of the released checkpoints
    "llama2_7b": 6_738_415_616,
    "llama2_13b": 13_015_864_320,
    "llama2_70b": 68_976_648_192,
    "llama3_8b": 8_030_261_248,
    "llama3_70b": 70_553_706_496,
    # Qwen2.5 / Qwen3 / Mistral: the tensors of the released safetensors, counted once (tied: no lm_head)
    "qwen2.5_0.5b": 494_032_768,
    "qwen2.5_7b": 7_615_616_512,
    "qwen2.5_72b": 72_706_203_648,
    "qwen3_0.6b": 596_049_920,
    "qwen3_8b": 8_190_735_360,
    "qwen3_32b": 32_762_123_264,
    "mistral_7b": 7_241_732_096,
}


@pytest.mark.parametrize("flavour", sorted(PUBLISHED))
def test_param_count_matches_published(flavour):
    assert count_params(FLAVOURS[flavour]) == PUBLISHED[flavour]


def test_param_count_matches_module():
    for over in (
        {"tie_embeddings": False},
        {"tie_embeddings": True},
        {"qkv_bias": True},
        {"qk_norm": True, "head_dim": 32},
    ):
        args = resolve_args("debug", **over)
        model = build_model(args, seed=0)
        assert count_params(args) == sum(p.numel() for p in model.parameters())


def _hf_pair(args, seed=0):
    torch.manual_seed(seed)
    hf_cfg = transformers.LlamaConfig(
        **{k: v for k, v in to_hf_config(args).items() if k not in ("architectures", "torch_dtype")}
    )
    hf_cfg._attn_implementation = "eager"
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # random norms too, so a swapped norm cannot pass
        for n, p in hf.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    ours = build_model(from_hf_config(to_hf_config(args)), seed=None)
    sd = {hf_to_native(k): v for k, v in hf.state_dict().items() if "rotary" not in k}
    if args.tie_embeddings:
        sd.pop("output.weight", None)
    missing, unexpected = ours.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= ({"output.weight"} if args.tie_embeddings else set())
    return hf, ours.eval()


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # debug: GQA 4 heads / 2 kv heads
        {"n_kv_heads": 4, "tie_embeddings": True},
        {
            "rope_theta": 500000.0,
            "rope_scaling": {
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
    ],
)
def test_logits_equal_transformers(overrides):
    args = resolve_args("debug", **overrides)
    hf, ours = _hf_pair(args)
    tokens = torch.randint(0, args.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(tokens).logits
        got = ours(tokens)
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() <= 1e-5


def test_names_round_trip():
    model = build_model(resolve_args("debug"), seed=0)
    for name, _ in model.named_parameters():
        assert hf_to_native(native_to_hf(name)) == name


def test_flops_per_token_counts_matmuls():
    from torch.utils.flop_counter import FlopCounterMode

    args = resolve_args("debug")
    model = build_model(args, seed=0)
    seq = 64
    tokens = torch.randint(0, args.vocab_size, (1, seq))
    # The math SDPA backend decomposes attention into bmm's the counter sees (the fused CPU
    # kernel is invisible to it), so attention FLOPs are counted too.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        model(tokens).sum().backward()
    measured = fc.get_total_flops() / seq
    assert abs(measured - flops_per_token(args, seq)) / measured < 0.02
