"""The GPT network: shapes, causality, initialisation, generation and optimizer groups."""

import math

import pytest
import torch
from conftest import tiny_gpt
from torch.nn import functional as F

from mingpt_ddp.config.optimizer import OptimizerConfig
from mingpt_ddp.errors import ConfigError
from mingpt_ddp.optim import build_optimizers
from model import GPT, MODEL_SIZES, GPTConfig


def tiny(**kw) -> GPT:
    return tiny_gpt(vocab_size=11, block_size=8, **kw)  # seeded: 2 layers, 2 heads, width 16


def test_forward_returns_logits_per_position_and_a_scalar_loss():
    model = tiny()
    idx = torch.randint(0, 11, (3, 8))
    logits, loss = model(idx, idx)
    assert logits.shape == (3, 8, 11)
    assert loss.shape == () and torch.isfinite(loss)
    assert model(idx)[1] is None


def test_initial_loss_is_close_to_uniform_guessing():
    model = tiny()
    idx, targets = torch.randint(0, 11, (2, 16, 8))
    _, loss = model(idx, targets)
    assert abs(loss.item() - math.log(11)) < 0.2  # small init: near-uniform predictions


def test_changing_a_future_token_leaves_earlier_logits_unchanged():
    model = tiny().eval()
    idx = torch.randint(0, 11, (1, 8))
    changed = idx.clone()
    changed[0, 5] = (idx[0, 5] + 1) % 11
    a, _ = model(idx)
    b, _ = model(changed)
    assert torch.equal(a[:, :5], b[:, :5])  # positions before 5 cannot see position 5
    assert not torch.allclose(a[:, 5:], b[:, 5:])  # positions from 5 on do


def test_attention_matches_explicit_boolean_masked_softmax():
    model = tiny().eval()
    attn = model.blocks[0].attn
    x = torch.randn(2, 8, 16)
    q, k, v = attn.qkv(x).split(16, dim=2)
    q, k, v = (t.view(2, 8, 2, 8).transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-2, -1) / math.sqrt(8)  # (B, nh, T, T)
    scores = scores.masked_fill(~torch.ones(8, 8, dtype=torch.bool).tril(), float("-inf"))
    y = (F.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(2, 8, 16)
    torch.testing.assert_close(attn(x), attn.proj(y))


def test_output_head_shares_the_token_embedding_matrix():
    model = tiny()
    assert model.lm_head.weight is model.wte.weight


def test_residual_projections_get_the_scaled_gpt2_init():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=8, n_head=4, n_embd=256, vocab_size=50, block_size=16))
    assert abs(model.blocks[0].mlp.proj.weight.std().item() - 0.02 / math.sqrt(16)) < 1e-3
    assert abs(model.blocks[0].mlp.fc.weight.std().item() - 0.02) < 1e-3


def test_generate_appends_tokens_and_is_reproducible_with_a_generator():
    model = tiny()
    prompt = torch.zeros(1, 3, dtype=torch.long)
    a = model.generate(prompt, 20, generator=torch.Generator().manual_seed(1))
    b = model.generate(prompt, 20, generator=torch.Generator().manual_seed(1))
    assert a.shape == (1, 23) and torch.equal(a, b)
    assert torch.equal(a[:, :3], prompt)
    assert model.training  # generate restores the mode it found


def test_generate_with_top_k_one_is_greedy():
    model = tiny()
    prompt = torch.tensor([[1, 2]])
    out = model.generate(prompt, 1, top_k=1)
    logits, _ = model.eval()(prompt)
    assert out[0, -1] == logits[0, -1].argmax()


def test_generate_longer_than_block_size_crops_the_context():
    out = tiny().generate(torch.zeros(2, 1, dtype=torch.long), 20)
    assert out.shape == (2, 21)


def test_optimizer_decays_matrices_but_not_biases_or_layernorm():
    model = tiny()
    [opt] = build_optimizers(model, OptimizerConfig(weight_decay=0.1), "cpu")
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and all(p.dim() >= 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and all(p.dim() == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    assert opt.defaults["fused"]


def test_every_named_size_builds_a_valid_shape():
    for _, (n_layer, n_head, n_embd) in MODEL_SIZES.items():
        GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd)  # heads divide the width
    assert MODEL_SIZES["gpt-micro"] == (
        GPTConfig().n_layer,
        GPTConfig().n_head,
        GPTConfig().n_embd,
    )  # the default


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"n_embd": 100, "n_head": 3}, "divisible"),
        ({"n_layer": 0}, "n_layer must be positive"),
        ({"dropout": 1.5}, "dropout"),
    ],
)
def test_invalid_shapes_are_config_errors(kwargs, needle):
    with pytest.raises(ConfigError, match=needle):
        GPTConfig(**kwargs)


def test_attention_switched_to_fp32_under_bf16_autocast_gives_the_same_result_to_bf16_rounding():
    idx = torch.randint(0, 11, (3, 8))
    model = tiny()
    with torch.no_grad():
        reference = model(idx, idx)[1]  # fp32 throughout
    losses = {}
    for fp32_attention in (False, True):
        for block in model.blocks:
            block.attn.fp32_under_autocast = fp32_attention
        seen = []
        hook = model.blocks[0].attn.proj.register_forward_pre_hook(
            lambda m, args, seen=seen: seen.append(args[0].dtype)
        )
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(idx, idx)
        hook.remove()
        loss.backward()  # and it trains
        losses[fp32_attention] = loss.item()
        # What attention hands the output projection: fp32 when it ran in fp32 (autocast casts it
        # for the matmul).
        assert seen == [torch.float32 if fp32_attention else torch.bfloat16]
    assert losses[True] == pytest.approx(reference.item(), rel=2e-2)
    assert losses[False] == pytest.approx(reference.item(), rel=2e-2)
