"""Pure domain logic: no Airflow, Kubernetes, boto3 or SQLAlchemy imports (DESIGN §3)."""
