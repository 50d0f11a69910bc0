"""Embedded runner: local subprocess workers, preemption injection, the `run` command."""
