"""The papers' fixes and the plain guards, organized by what they do, one implementation each.

clipping.py        the policy term's clip (clip-higher, dual-clip), advantage and gradient-norm clipping
entropy.py         entropy bonus
kl.py              the KL term to a reference: estimator placement (kl-k2, kl-max, kl-k1-reward), KL anchors
importance.py      importance-sampling corrections for stale or mismatched samplers
                   (token-tis, seq-tis, turn-is, vtrace)
aggregation.py     aggregation and baseline of the policy term, group filters
                   (constant-norm, dr-grpo, variance-filter, difficulty-filter)
architecture.py    network changes (multiskip-residual, markovian-chunks)
critics.py         value estimates (mini-critics, critic-warmup, chain)
representation.py  feature regularizers (isotropic-gaussian)
resets.py          re-initializing part of the network when the return falls (head-reset)
routing.py         Mixture-of-Experts routing replay (routing-replay: the sampler's routes, R3; routing-replay-old: R2)
reward_models.py   learned-reward ensembles (conservative-ensemble)
rewards.py         terms added to the task's reward (brier-reward)
tool_states.py     tool-state tokens apart from text tokens (tool-state-groups)
verl_losses.py     verl's policy losses as the policy term, unchanged (verl:NAME, verl:FILE.py:FUNCTION; needs .[verl])
"""
