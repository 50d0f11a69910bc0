"""Airflow extra links of the deadline-batch provider."""
