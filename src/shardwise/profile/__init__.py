"""Why is a job slow: the per-step ledger, traces, and findings priced by the planner."""
