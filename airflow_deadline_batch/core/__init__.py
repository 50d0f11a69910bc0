"""Pure domain logic: no Airflow, Kubernetes, boto3 or SQLAlchemy imports (docs/design.md §3)."""
