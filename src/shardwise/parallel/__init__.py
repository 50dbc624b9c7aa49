"""Parallelisms as transformations of a plain model; one `apply_*` entry per module."""
