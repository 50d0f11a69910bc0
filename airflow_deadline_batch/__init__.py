"""Deadline-aware LLM batch inference on Spot GPUs, as an Airflow provider."""

__version__ = "0.1.0"
