"""The OpenAI Batch front door: ``/deadline-batch/openai/v1`` in Airflow's api-server (docs/openai.md)."""
