"""Airflow sensors of the deadline-batch provider."""
