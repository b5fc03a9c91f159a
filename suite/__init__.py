"""The harness: the public contract (`api`), registries, runner (Ray Tune), diagnostics, detectors, scoring (per-run
`outcomes`, `statistics`, detector `skill`, `formatting`), leaderboard, paper and the `stabench` command. Users import
`stabench`, which re-exports the public part."""

__version__ = "0.3.0"  # 0.3: one batch schema for every trainer, stabilizers by function, the method matrix
