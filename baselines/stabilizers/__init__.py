"""The papers' fixes (and named non-fixes) as stabilizers, one file each."""
