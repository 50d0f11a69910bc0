"""Airflow triggers of the deadline-batch provider."""
