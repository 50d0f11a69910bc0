"""Airflow plugins of the deadline-batch provider."""
