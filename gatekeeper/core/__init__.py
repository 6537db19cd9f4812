"""The pure core: the dwell gate, the ledger's arithmetic, the review and freeze rules, and
what a gated task declares. No Redis, no Celery, no clock, no logging: the drill, the Redis
adapter and the Celery adapter all call these same functions (``tests/test_layout.py`` holds
that nothing here imports an I/O library, even indirectly)."""
