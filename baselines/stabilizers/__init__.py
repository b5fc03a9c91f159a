"""The papers' fixes and the plain guards, one module per kind of change (clipping, entropy, KL terms, importance
corrections, aggregation, architecture, critics, representations, resets, routing, reward models, rewards, tool
states, verl's losses), one implementation each.

Each module's docstring says what its methods do. A class here that sets a literal `name` is a built-in method,
found in its module's source (`stabench.suite.registry.discover`): `stabench list` names them all, and no list here
repeats them.
"""
