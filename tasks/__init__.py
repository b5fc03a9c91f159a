"""Failure-mode tasks, one module per failure mode. Importing a module registers its gymnasium
environments under the `stabench/` namespace; `suite.registry` names the modules."""
