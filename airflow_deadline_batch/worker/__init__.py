"""The shard worker program and its inference engines. Runs in the pod: never imports Airflow."""
