"""Readable trainers, one file per algorithm, with named hook points for stabilizers."""
