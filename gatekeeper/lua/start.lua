-- start.lua: a worker started a run of a gated attempt.
--
-- Counts the run, remembers what its row will need, marks it started (for the sweep) and
-- drops the attempt from the free queue's waiting set. When an earlier run of the same
-- attempt never got its row (its worker died and the broker redelivered the message), that
-- run's record is returned before it is overwritten, so the caller can record it as killed.
--
-- KEYS[1] run:<job_id>:<attempt>   hash: runs, rowed, started_ms, and the fields below
-- KEYS[2] started                   sorted set: <job_id>:<attempt> -> start time (ms)
-- KEYS[3] free:waiting              sorted set: admitted free attempts not yet started
-- KEYS[4] stats                     hash: reruns_after_row (a run of an attempt that already
--                                   had its row: the broker delivered a finished message again)
--
-- ARGV[1] member          <job_id>:<attempt>
-- ARGV[2] now_ms
-- ARGV[3] retention_s     TTL of the run hash
-- ARGV[4..] field, value pairs describing the run (published_ms, deadline_ms, path, ...)
--
-- Returns {run, dead_run, dead_fields...}: dead_run is 0 when no earlier run is missing its
-- row; otherwise dead_fields are the earlier run's field, value pairs.

local run = redis.call('HINCRBY', KEYS[1], 'runs', 1)
local rowed = tonumber(redis.call('HGET', KEYS[1], 'rowed') or '0')
local reply = {run, 0}
if run > 1 and rowed >= run - 1 then
  redis.call('HINCRBY', KEYS[4], 'reruns_after_row', 1)
end
if run > 1 and rowed < run - 1 then
  reply[2] = run - 1
  local previous = redis.call('HGETALL', KEYS[1])
  for i = 1, #previous do reply[#reply + 1] = previous[i] end
end
local fields = {'started_ms', ARGV[2]}
for i = 4, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[3]))
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
return reply
