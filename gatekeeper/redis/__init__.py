"""The Redis adapter: every key name (:mod:`.keys`), the Lua scripts and the stores that call
them (:mod:`.store`, :mod:`.runs`, :mod:`.flags`), the gate's own connection (:mod:`.wire`) and
the decision of one publish (:mod:`.gate`). Imports the core, never Celery or kombu."""
