"""Planning, verification and publication, shared by the CLI and the Airflow operators."""
