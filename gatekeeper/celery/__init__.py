"""The Celery adapter: the publish seam (:mod:`.hook`), the worker side (:mod:`.worker`), the
replayer and metering. Every touch of private Celery and kombu API lives in :mod:`.private`,
with the shape checks that fail loudly when it changes."""
