"""Token machinery shared by the token trainers and the token tasks: a tiny causal transformer policy built
from a config (never downloaded), ancestral sampling from it, and the log-probs of given answers.

Conventions: the policy's vocabulary is `n_actions` answer tokens (ids 0 .. n_actions - 1) plus one special
token, id `n_actions`, that serves as BOS, EOS and padding; a policy only ever emits answer tokens (its
next-token distribution is the softmax over the first `n_actions` logits). A prompt is a LongTensor [B, P]
that starts with BOS, an answer a LongTensor [B, L]. A reward function maps `(prompts, answers)` to a
FloatTensor [B] (or a dict with "reward" [B] and other per-answer tensors). It lives here, below both the
trainers and the tasks, so that trainers never import a task.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

RewardFn = Callable[[torch.Tensor, torch.Tensor], "torch.Tensor | dict[str, torch.Tensor]"]


def on_default_device(array: np.ndarray) -> torch.Tensor:
    """A numpy array as a tensor on torch's default device (the CPU unless a GPU run made CUDA the default)."""
    return torch.from_numpy(array).to(torch.get_default_device())


def tiny_policy(n_actions: int, max_len: int, n_embd: int = 32, n_layer: int = 1, n_head: int = 2) -> nn.Module:
    """A GPT-2 with `n_actions + 1` token ids (the last is BOS/EOS), no dropout, random init (seeded by torch)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    special = n_actions
    config = GPT2Config(
        vocab_size=n_actions + 1,
        n_positions=max_len,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        bos_token_id=special,
        eos_token_id=special,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    config._attn_implementation = "sdpa"
    return GPT2LMHeadModel(config)


def bos_prompts(model: nn.Module, n: int) -> torch.Tensor:
    """n prompts made of the BOS token alone: LongTensor [n, 1]."""
    return torch.full((n, 1), model.config.bos_token_id, dtype=torch.long)


def _plain_gpt2(model: nn.Module) -> bool:
    """True where `model` is exactly what `tiny_policy` builds, so `_gpt2_logits` computes its forward: a plain
    `GPT2LMHeadModel` (not a subclass, not wrapped), sdpa attention, GPT-2's GELU, no dropout that could draw, no
    hooks anywhere, no cross-attention, no gradient checkpointing."""
    from torch.nn.modules import module as torch_module

    gpt2 = _gpt2_classes()
    if type(model) is not gpt2["lm"]:
        return False
    config = model.config
    if (config._attn_implementation != "sdpa" or config.add_cross_attention or config.activation_function != "gelu_new"
            or model.transformer.gradient_checkpointing or model.lm_head.bias is not None):
        return False
    if any(getattr(torch_module, name) for name in _GLOBAL_HOOKS):
        return False
    parts, training, drops = gpt2["parts"], False, False
    for mod in model.modules():
        if (type(mod) not in parts or mod._forward_hooks or mod._forward_pre_hooks or mod._backward_hooks
                or mod._backward_pre_hooks):
            return False
        training |= mod.training
        drops |= type(mod) is nn.Dropout and mod.p != 0
    return not (training and drops)


_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks", "_global_forward_hooks_always_called")
_GPT2: dict = {}


def _gpt2_classes() -> dict:
    if not _GPT2:
        from transformers.activations import NewGELUActivation
        from transformers.models.gpt2 import modeling_gpt2 as g
        from transformers.pytorch_utils import Conv1D

        _GPT2["lm"] = g.GPT2LMHeadModel
        _GPT2["parts"] = frozenset({g.GPT2LMHeadModel, g.GPT2Model, g.GPT2Block, g.GPT2Attention, g.GPT2MLP,
                                    Conv1D, NewGELUActivation, nn.Embedding, nn.LayerNorm, nn.Linear, nn.Dropout,
                                    nn.ModuleList})
    return _GPT2


def _conv1d(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """transformers' `Conv1D.forward`: addmm on the flattened input."""
    size_out = x.size()[:-1] + (layer.nf,)
    return torch.addmm(layer.bias, x.view(-1, x.size(-1)), layer.weight).view(size_out)


def _layer_norm(ln: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    return nn.functional.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps)


def _gelu_new(act: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """transformers' `NewGELUActivation` of x; without autograd, the same operations on the same values in place (x
    is a temporary), which spares five tensors the size of x: a third of an exact evaluation's time."""
    if torch.is_grad_enabled():
        return act.forward(x)
    inner = torch.pow(x, 3.0).mul_(0.044715).add_(x).mul_(math.sqrt(2.0 / math.pi)).tanh_().add_(1.0)
    return x.mul_(0.5).mul_(inner)


def _gpt2_logits(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """`model(input_ids=input_ids, use_cache=False).logits` of a `_plain_gpt2` model, bit for bit: the same tensor
    operations on the same shapes and layouts, in the same order (so the backward is the same too), without
    transformers' per-call machinery (output capture, mask construction, deprecation wrappers), which costs more
    than the arithmetic at these sizes. Without a cache or an attention mask, transformers passes sdpa no mask and
    `is_causal` = (more than one position); a dropout that cannot draw (p = 0, or eval mode) returns its input."""
    hidden = _gpt2_hidden(model, input_ids)
    return nn.functional.linear(hidden[:, slice(0, None), :], model.lm_head.weight)


def _gpt2_hidden(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """`model.transformer(input_ids=input_ids, use_cache=False).last_hidden_state` of a `_plain_gpt2` model, bit for
    bit (see `_gpt2_logits`)."""
    tr = model.transformer
    emb = tr.wte
    input_shape = input_ids.size()
    input_ids = input_ids.view(-1, input_shape[-1])
    inputs_embeds = nn.functional.embedding(input_ids, emb.weight, emb.padding_idx, emb.max_norm, emb.norm_type,
                                            emb.scale_grad_by_freq, emb.sparse)
    position_ids = (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + 0).unsqueeze(0)
    pos = tr.wpe
    position_embeds = nn.functional.embedding(position_ids, pos.weight, pos.padding_idx, pos.max_norm, pos.norm_type,
                                              pos.scale_grad_by_freq, pos.sparse)
    hidden = inputs_embeds + position_embeds
    output_shape = (-1,) + input_shape[1:] + (hidden.size(-1),)
    q_length = hidden.shape[1]
    for block in tr.h:
        attn = block.attn
        residual = hidden
        hidden = _layer_norm(block.ln_1, hidden)
        query, key, value = _conv1d(attn.c_attn, hidden).split(attn.split_size, dim=2)
        shape = (*key.shape[:-1], -1, attn.head_dim)
        key, value = key.view(shape).transpose(1, 2), value.view(shape).transpose(1, 2)
        query = query.view((*query.shape[:-1], -1, attn.head_dim)).transpose(1, 2)
        out = nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=None, dropout_p=attn.attn_dropout.p if attn.training else 0.0,
            scale=attn.scaling, is_causal=q_length > 1,
        )
        out = out.reshape(out.shape[0], -1, q_length, value.shape[-1]).transpose(1, 2).contiguous()
        hidden = _conv1d(attn.c_proj, out.reshape(*out.shape[:-2], -1).contiguous()) + residual
        residual = hidden
        mlp = block.mlp
        hidden = residual + _conv1d(mlp.c_proj, _gelu_new(mlp.act, _conv1d(mlp.c_fc, _layer_norm(block.ln_2, hidden))))
    return _layer_norm(tr.ln_f, hidden).view(output_shape)


def lm_hidden(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """`model.transformer(input_ids=input_ids, use_cache=False).last_hidden_state`; for the plain tiny GPT-2 of
    `tiny_policy`, the same numbers bit for bit without transformers' per-call overhead (`_gpt2_hidden`)."""
    if _plain_gpt2(model):
        return _gpt2_hidden(model, input_ids)
    return model.transformer(input_ids=input_ids, use_cache=False).last_hidden_state


def lm_logits(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """`model(input_ids=input_ids, use_cache=False).logits`; for the plain tiny GPT-2 of `tiny_policy`, the same
    numbers bit for bit, computed without transformers' per-call overhead (`_gpt2_logits`)."""
    if _plain_gpt2(model):
        return _gpt2_logits(model, input_ids)
    return model(input_ids=input_ids, use_cache=False).logits


def answer_logits(model: nn.Module, prompts: torch.Tensor, answers: torch.Tensor, n_actions: int) -> torch.Tensor:
    """Logits [B, L, n_actions] of each answer token given the prompt and the answer tokens before it.

    One forward over `prompts ++ answers[:, :-1]`; position P - 1 + t predicts answer token t.
    """
    inputs = torch.cat([prompts, answers[:, :-1]], dim=1)
    logits = lm_logits(model, inputs)
    return logits[:, prompts.shape[1] - 1 :, :n_actions]


@torch.no_grad()
def sample_answers(
    model: nn.Module, prompts: torch.Tensor, length: int, n_actions: int, rng: np.random.Generator
) -> torch.Tensor:
    """Ancestral sampling of `length` answer tokens per prompt: LongTensor [B, length].

    Randomness comes only from `rng` (inverse-CDF sampling with its uniforms), so a run that holds its
    own numpy Generator is reproducible and branches cleanly under `copy.deepcopy`.
    """
    seq = prompts
    plain = _plain_gpt2(model)  # checked once: nothing but these forwards runs until the answers are drawn
    for _ in range(length):
        full = _gpt2_logits(model, seq) if plain else model(input_ids=seq, use_cache=False).logits
        logits = full[:, -1, :n_actions]
        cdf = torch.softmax(logits.double(), dim=-1).cumsum(-1)
        u = on_default_device(rng.random(len(seq)))[:, None] * cdf[:, -1:]
        token = (cdf < u).sum(-1).clamp_max(n_actions - 1)
        seq = torch.cat([seq, token[:, None]], dim=1)
    return seq[:, prompts.shape[1] :]


def answer_mask(answers: torch.Tensor, eos_id: int | None = None) -> torch.Tensor:
    """1.0 on the tokens of each answer up to and including its first `eos_id`, 0.0 after (all ones if None)."""
    if eos_id is None:
        return torch.ones(answers.shape, dtype=torch.float32)
    is_eos = (answers == eos_id).long()
    after_eos = (is_eos.cumsum(1) - is_eos) > 0
    return (~after_eos).float()


def group_std(rewards: torch.Tensor) -> torch.Tensor:
    """Each group's std [n_groups, 1] of rewards [n_groups, group_size] (unbiased, as GRPO); 1 for groups of one,
    whose std is undefined (verl's convention): such an answer's advantage is its centred reward, 0 under the
    group baseline, where the unbiased std of one element would make it NaN."""
    if rewards.shape[1] == 1:
        return torch.ones_like(rewards)
    return rewards.std(1, keepdim=True)
