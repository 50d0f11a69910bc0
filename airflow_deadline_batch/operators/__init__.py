"""Airflow operators of the deadline-batch provider."""
