-- unverified.lua: the runs of an attempt the gate has no record of, and their rows.
--
-- A message with no nonce (a publisher that predates records, or a decision made without
-- Redis) gets an unverified row for each run, unpriced (SPEC section 2). Its runs are counted
-- here, in a small hash of their own (never the gate's record, which a caller's task id could
-- name), so that a run killed with its pool child still gets its row from the main process,
-- a dead run is found by the next run of a redelivered message, and a signal that fires twice
-- writes one row.
--
-- ARGV[1] is what to do:
--
-- 'start': a run of the attempt began.
--   KEYS[1] unverified:<job_id>:<attempt>  hash: runs, rowed (the last run with its row),
--                                          started_ms (of the latest run), start_token,
--                                          start_reply
--   KEYS[2] stats                          hash: unverified_runs
--   ARGV[2] now_ms  ARGV[3] ttl_s  ARGV[4] token (the same again: a start re-sent after a
--   lost reply, answered as before, counting nothing)
--   Returns {run, dead_run, dead_started_ms}: dead_run is the run before this one when it
--   never got its row (its worker died and the broker delivered the message again), else 0.
--
-- 'row': write the row of run ARGV[2] ('0': the latest run) unless it has one.
--   KEYS[1] unverified:<job_id>:<attempt>
--   KEYS[2] window:<row window>:rows  list: ledger rows (JSON)
--   KEYS[3] window:<row window>       hash: unverified:<outcome>
--   KEYS[4] totals                    hash: lifetime counts (never expire)
--   ARGV[2] run  ARGV[3] row (JSON)  ARGV[4] outcome  ARGV[5] retention_s (the window's)
--   ARGV[6] totals field ('': none)
--   Returns {1} when the row was written, {0} when the run had it already or never started
--   (a table, as every script on the worker's line answers: gatekeeper/redis/wire.py).

if ARGV[1] == 'start' then
  local held = redis.call('HMGET', KEYS[1], 'start_token', 'start_reply', 'runs', 'rowed',
    'started_ms')
  if ARGV[4] ~= '' and held[1] == ARGV[4] then
    local run, dead, dead_ms = string.match(held[2], '^(%d+)|(%d+)|(%d+)$')
    return {tonumber(run), tonumber(dead), dead_ms}
  end
  redis.call('HINCRBY', KEYS[2], 'unverified_runs', '1')
  local run = tonumber(held[3] or '0') + 1
  local dead, dead_ms = 0, '0'
  if run > 1 and tonumber(held[4] or '0') < run - 1 then
    dead, dead_ms = run - 1, held[5] or '0'
  end
  redis.call('HSET', KEYS[1], 'runs', run, 'started_ms', ARGV[2], 'start_token', ARGV[4],
    'start_reply', run .. '|' .. dead .. '|' .. dead_ms)
  redis.call('EXPIRE', KEYS[1], ARGV[3])
  return {run, dead, dead_ms}
end

local held = redis.call('HMGET', KEYS[1], 'runs', 'rowed')
local run = tonumber(ARGV[2])
if run == 0 then run = tonumber(held[1] or '0') end
if run == 0 or tonumber(held[2] or '0') >= run then
  return {0}
end
redis.call('HSET', KEYS[1], 'rowed', run)
redis.call('RPUSH', KEYS[2], ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[5])
redis.call('HINCRBY', KEYS[3], 'unverified:' .. ARGV[4], '1')
redis.call('EXPIRE', KEYS[3], ARGV[5])
if ARGV[6] ~= '' then
  redis.call('HINCRBY', KEYS[4], ARGV[6], '1')
end
return {1}
