"""Test and benchmark helpers: run many configurations in one spawned world of gloo ranks."""

from shardwise.testing.harness import run_world

__all__ = ["run_world"]
