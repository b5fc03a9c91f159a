"""Adam's `step` and `zero_grad` for the trainers, without `torch.optim`'s per-call Python.

A trainer's update on these small networks costs a few hundred microseconds of arithmetic, and `Optimizer.step`
added about as much again: profiler ranges, hook dispatch, regrouping the tensors by device and dtype, and the
lazy-state and option checks, on every call. `step(optimizer)` performs the update of a plain `torch.optim.Adam`
(fused, or foreach) with the same tensor operations, in the same order, on the same tensors as torch 2.13's
`_fused_adam` and `_multi_tensor_adam` (their non-capturable CPU paths), so the parameters and the optimizer state
are the same bit for bit; every other optimizer, a subclass, an Adam with hooks or options those paths do not
take, and the first step (which creates the state) go through `optimizer.step()` itself. `zero_grad(optimizer)` is
`optimizer.zero_grad(set_to_none=True)`. tests/test_adam.py checks both against torch's own over many steps.

`update(...)` is one update as every trainer makes it: zero_grad, backward, the raw gradients (when reported),
the stabilizer's `after_backward`, the step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.optim import optimizer as torch_optimizer

if TYPE_CHECKING:
    from stabench.suite.api import Stabilizer
    from torch import nn

_TORCH = torch.__version__.split("+")[0]


def _plain(optimizer: torch.optim.Optimizer) -> bool:
    """True for a plain `torch.optim.Adam` this module can step: no hooks (its own or global), torch 2.13."""
    return (type(optimizer) is torch.optim.Adam and _TORCH.startswith("2.13.")
            and not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks
            and not torch_optimizer._global_optimizer_pre_hooks and not torch_optimizer._global_optimizer_post_hooks
            and "step" not in vars(optimizer) and "zero_grad" not in vars(optimizer))


def zero_grad(optimizer: torch.optim.Optimizer) -> None:
    """`optimizer.zero_grad(set_to_none=True)`: every parameter's gradient set to None."""
    if not _plain(optimizer):
        optimizer.zero_grad(set_to_none=True)
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None


def _group(optimizer: torch.optim.Optimizer, group: dict) -> tuple[list, ...] | None:
    """The lists `Adam._init_group` builds for a group (params with a gradient, their gradients, first and second
    moments, steps), or None where this module's paths do not apply (first step, options, devices, dtypes)."""
    if (group["amsgrad"] or group["maximize"] or group["capturable"] or group["differentiable"]
            or group["weight_decay"] != 0 or group.get("decoupled_weight_decay", False)
            or not isinstance(group["lr"], float) or not all(isinstance(b, float) for b in group["betas"])
            or bool(group["fused"]) == bool(group["foreach"])):
        return None
    params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
    for p in group["params"]:
        grad = p.grad
        if grad is None:
            continue
        state = optimizer.state.get(p)
        if not state or grad.is_sparse or p.device.type != "cpu" or p.dtype != torch.float32 or p.is_complex():
            return None
        params.append(p)
        grads.append(grad)
        exp_avgs.append(state["exp_avg"])
        exp_avg_sqs.append(state["exp_avg_sq"])
        steps.append(state["step"])
    return params, grads, exp_avgs, exp_avg_sqs, steps


def step(optimizer: torch.optim.Optimizer) -> None:
    """`optimizer.step()`, bit for bit (see the module docstring)."""
    if not _plain(optimizer):
        optimizer.step()
        return
    groups = [_group(optimizer, group) for group in optimizer.param_groups]
    if any(g is None for g in groups):
        optimizer.step()
        return
    with torch.no_grad():
        for group, (params, grads, exp_avgs, exp_avg_sqs, steps) in zip(optimizer.param_groups, groups):
            if not params:
                continue
            lr, eps = group["lr"], group["eps"]
            beta1, beta2 = group["betas"]
            if group["fused"]:  # torch.optim.adam._fused_adam
                torch._foreach_add_(steps, 1)
                torch._fused_adam_(params, grads, exp_avgs, exp_avg_sqs, [], steps, amsgrad=False, lr=lr,
                                   beta1=beta1, beta2=beta2, weight_decay=0.0, eps=eps, maximize=False,
                                   grad_scale=None, found_inf=None)
                continue
            # torch.optim.adam._multi_tensor_adam, not capturable, steps on the CPU
            torch._foreach_add_(steps, torch.tensor(1.0, device="cpu"), alpha=1.0)
            torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
            torch._foreach_mul_(exp_avg_sqs, beta2)
            torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
            bias_correction1 = [1 - beta1 ** s.item() for s in steps]
            bias_correction2 = [1 - beta2 ** s.item() for s in steps]
            step_size = [(lr / bc) * -1 for bc in bias_correction1]
            bias_correction2_sqrt = [bc**0.5 for bc in bias_correction2]
            exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)
            torch._foreach_div_(exp_avg_sq_sqrt, bias_correction2_sqrt)
            torch._foreach_add_(exp_avg_sq_sqrt, eps)
            torch._foreach_addcdiv_(params, exp_avgs, exp_avg_sq_sqrt, step_size)


def update(loss: torch.Tensor, model: nn.Module, optimizer: torch.optim.Optimizer, stabilizer: Stabilizer,
           reported: bool) -> dict[str, torch.Tensor] | None:
    """zero_grad -> backward -> the raw gradients, before the stabilizer edits them (returned when `reported`;
    a `None` gradient: no update there) -> `stabilizer.after_backward(model)` -> the optimizer step.

    Where the stabilizer drops every gradient (the references) and nobody reads this update's gradients, the
    whole update is skipped and None returned: it would change nothing."""
    if not reported and stabilizer.drops_all_gradients():
        return None
    zero_grad(optimizer)
    loss.backward()
    grads = ({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
             if reported else None)
    stabilizer.after_backward(model)
    step(optimizer)
    return grads
