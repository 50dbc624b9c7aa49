"""The planner: per-rank memory by category and step time of every layout, before launch.

hardware.py (catalog; calibrate.py measures `cpu`) -> shapes.py (a model's ZeRO units without
a model) -> activations.py (Korthikanti et al. 2022 terms of our blocks) -> memory.py
(`mem_bytes` per rank) -> time.py (step time, traffic) -> search.py (enumerate, reject, rank)
-> report.py / cli.py (`shardwise plan`), predict.py (`explain`), auto.py (`train --plan
auto`), verify.py (`plan --verify`, the accuracy benchmark)."""
