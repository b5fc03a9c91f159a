"""What several tasks share, below the tasks: worlds and run scaffolding.

- `tokens`: the token family's tiny policy, sampling, enumeration, answer environments and `WarmStart` (the
  built-in warm starts as shipped, hash-checked files; a plugin's in the run-time cache).
- `digits`: the digit world eight reasoning tasks train in (prompts, rules, the warm start, exact held-out
  statistics, the GRPO settings and budgets they share).
- `grids`: flattened MiniGrid rooms for the grid family.
- `tools`: the tool-call world of the tools family (slots, the tool's table, the policy, the batched world and
  its gymnasium environment, the warm-up, the exact returns).
- `tool_detection`: the tools family's detection study (tool-state diagnostics against their aggregates), whose
  table the paper shows.
- `scaffold`: the run pieces every task writes the same way (the onset knob, trailing windows, a GRPO run base).

A module here never imports a task module; tasks import from here.
"""
