"""The job layer: everything between a config and a launch, written once (prepare.py)."""

from shardwise.job.prepare import PreparedJob, check_restarts, prepare

__all__ = ["PreparedJob", "check_restarts", "prepare"]
