"""``dtrain ui``: a read-only web view of the job store (jobs, logs, metrics, plans, files)."""
