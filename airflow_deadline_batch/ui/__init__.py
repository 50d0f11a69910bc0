"""The jobs view served in Airflow's UI.

``model``: page data from the job view and the store; ``render``: HTML and inline SVG (pure);
``access``: who may read a job, through Airflow's auth manager.
"""
