-- unpair.lua: forget deployment pairs unseen long enough (gatekeeper/redis/deployment.py), each
-- only if its value is still the one read: a process that wrote it again since keeps it.
--
-- KEYS[1] deployment  hash: <window_seconds>|<budget_units, or rows> ->
--                     <last seen, Unix s>|<host>:<pid>
--
-- ARGV    field, value, field, value, ...: the pairs to forget, as they were read
--
-- Returns how many were deleted.

local deleted = 0
for i = 1, #ARGV, 2 do
  if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[i + 1] then
    deleted = deleted + redis.call('HDEL', KEYS[1], ARGV[i])
  end
end
return deleted
