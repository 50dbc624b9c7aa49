"""The planner: per-rank memory by category and step time of every layout, before launch.

hardware.py (catalog; calibrate.py measures `cpu`) -> shapes.py (a model's ZeRO units without
a model) -> activations.py (Korthikanti et al. 2022 terms of our blocks) -> memory.py
(`mem_bytes` per rank) -> time.py (step time, traffic) -> search.py (enumerate, reject, rank)
-> report.py (`shardwise plan`'s table). It prices a description of a job (layout.Job) and
imports nothing of the runtime; the job layer (shardwise.job) turns a config into that
description. peers.py says how another framework's run costs differ from ours, for pricing
the published record only."""
