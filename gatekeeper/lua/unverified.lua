-- unverified.lua: the runs of an attempt the gate has no record of, and their rows.
--
-- A message with no nonce (a publisher that predates records, or a decision made without
-- Redis) gets an unverified row for each run, unpriced (SPEC section 2). Its runs are counted
-- here, in a small hash of their own (never the gate's record, which a caller's task id could
-- name), with what a row needs, so that a run killed with its pool child gets its row from
-- the main process, one whose whole worker vanished from the sweep, a dead run is found by the
-- next run of a redelivered message, and a signal that fires twice writes one row.
--
-- ARGV[1] is what to do:
--
-- 'start': a run of the attempt began.
--   KEYS[1] unverified:<job_id>:<attempt>  hash: runs, rowed (the last run with its row),
--                                          rowed_by, started_ms (of the latest run),
--                                          start_token, start_reply, and the fields below
--   KEYS[2] stats                          hash: unverified_runs
--   KEYS[3] unverified:started             sorted set: <job_id>:<attempt> -> start (ms),
--                                          while its latest run has no row (the sweep's)
--   ARGV[2] member <job_id>:<attempt>  ARGV[3] now_ms  ARGV[4] ttl_s
--   ARGV[5] token (the same again: a start re-sent after a lost reply, answered as before,
--   counting nothing)
--   ARGV[6..] field, value pairs: what the run's row needs (task, worker, decision, times,
--   tokens, retries, time_limit_s), as the worker read them from the message
--   Returns {run, dead_run, dead_started_ms}: dead_run is the run before this one when it
--   never got its row (its worker died and the broker delivered the message again), else 0.
--
-- 'row': write the row of run ARGV[3] unless it has one.
--   KEYS[1] unverified:<job_id>:<attempt>
--   KEYS[2] window:<row window>:rows  list: ledger rows (JSON)
--   KEYS[3] window:<row window>       hash: unverified:<outcome>
--   KEYS[4] totals                    hash: lifetime counts (never expire)
--   KEYS[5] unverified:started
--   ARGV[2] member  ARGV[3] run  ARGV[4] row (JSON)  ARGV[5] outcome
--   ARGV[6] retention_s (the window's)  ARGV[7] totals field ('': none)  ARGV[8] ttl_s
--   ARGV[9] token (this call's: the same again after a lost reply is told it wrote the row)
--   Returns {1} when this call wrote the row, {0} when the run had it already (a table, as
--   every script on the worker's line answers: gatekeeper/redis/wire.py).

if ARGV[1] == 'start' then
  local held = redis.call('HMGET', KEYS[1], 'start_token', 'start_reply', 'runs', 'rowed',
    'started_ms')
  if ARGV[5] ~= '' and held[1] == ARGV[5] then
    local run, dead, dead_ms = string.match(held[2], '^(%d+)|(%d+)|(%d+)$')
    return {tonumber(run), tonumber(dead), dead_ms}
  end
  redis.call('HINCRBY', KEYS[2], 'unverified_runs', '1')
  local run = tonumber(held[3] or '0') + 1
  local dead, dead_ms = 0, '0'
  if run > 1 and tonumber(held[4] or '0') < run - 1 then
    dead, dead_ms = run - 1, held[5] or '0'
  end
  local fields = {'runs', run, 'started_ms', ARGV[3], 'start_token', ARGV[5],
    'start_reply', run .. '|' .. dead .. '|' .. dead_ms}
  for i = 6, #ARGV do fields[#fields + 1] = ARGV[i] end
  redis.call('HSET', KEYS[1], unpack(fields))
  redis.call('EXPIRE', KEYS[1], ARGV[4])
  redis.call('ZADD', KEYS[3], ARGV[3], ARGV[2])
  return {run, dead, dead_ms}
end

local held = redis.call('HMGET', KEYS[1], 'runs', 'rowed', 'rowed_by')
local run = tonumber(ARGV[3])
if tonumber(held[2] or '0') >= run then
  return {(held[3] == ARGV[9] and ARGV[9] ~= '') and 1 or 0}
end
redis.call('HSET', KEYS[1], 'rowed', ARGV[3], 'rowed_by', ARGV[9])
redis.call('EXPIRE', KEYS[1], ARGV[8])
if run >= tonumber(held[1] or '0') then  -- its latest run: nothing left for the sweep
  redis.call('ZREM', KEYS[5], ARGV[2])
end
redis.call('RPUSH', KEYS[2], ARGV[4])
redis.call('EXPIRE', KEYS[2], ARGV[6])
redis.call('HINCRBY', KEYS[3], 'unverified:' .. ARGV[5], '1')
redis.call('EXPIRE', KEYS[3], ARGV[6])
if ARGV[7] ~= '' then
  redis.call('HINCRBY', KEYS[4], ARGV[7], '1')
end
return {1}
