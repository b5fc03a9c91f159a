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


def answer_logits(model: nn.Module, prompts: torch.Tensor, answers: torch.Tensor, n_actions: int) -> torch.Tensor:
    """Logits [B, L, n_actions] of each answer token given the prompt and the answer tokens before it.

    One forward over `prompts ++ answers[:, :-1]`; position P - 1 + t predicts answer token t.
    """
    inputs = torch.cat([prompts, answers[:, :-1]], dim=1)
    logits = model(input_ids=inputs, use_cache=False).logits
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
    for _ in range(length):
        logits = model(input_ids=seq, use_cache=False).logits[:, -1, :n_actions]
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
