"""Airflow notifiers of the deadline-batch provider."""
