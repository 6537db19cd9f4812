"""A runnable Celery app for gatekeeper: its worker entry points and the demo tasks."""
