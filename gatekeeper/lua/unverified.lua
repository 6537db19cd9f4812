-- unverified.lua: the runs of an attempt the gate has no record of, and their rows.
--
-- A message with no nonce (a publisher that predates records, or a decision made without
-- Redis) gets an unverified row for each run, unpriced (SPEC section 2). Its runs are counted
-- here, in a small hash of their own (never the gate's record, which a caller's task id could
-- name), with what a row needs, so that a run killed with its pool child gets its row from
-- the main process, one whose whole worker vanished from the sweep, a dead run is found by the
-- redelivered copy of its message, and a signal that fires twice writes one row. Each run is
-- rowed on its own (`r:<run>`), never as "every run up to n": two copies of one task id (a
-- caller's) may run at once and end in any order.
--
-- KEYS[1] unverified:<job_id>:<attempt>  hash: runs; o:<run> = '<started_ms>|<pid>|<worker>'
--                                        while the run has no row; r:<run> = the token of the
--                                        call that wrote its row; open (runs without a row);
--                                        t:<token> = a start's reply; the row's fields (below)
--
-- ARGV[1] is what to do:
--
-- 'start': a run of the attempt began.
--   KEYS[2] stats               hash: unverified_runs
--   KEYS[3] unverified:started  sorted set: <job_id>:<attempt> -> latest start (ms), while a
--                               run of it has no row (the sweep's)
--   ARGV[2] member <job_id>:<attempt>  ARGV[3] now_ms  ARGV[4] ttl_s
--   ARGV[5] token (the same again: a start re-sent after a lost reply, answered as before)
--   ARGV[6] redelivered ('1': the broker delivered this message again: the run before it, if
--           it has no row, died with its worker)  ARGV[7] the pool child's pid
--   ARGV[8] the worker's name  ARGV[9..] field, value pairs: what the run's row needs (task,
--   decision, times, tokens, retries, time_limit_s), as the worker read them from the message
--   Returns {run, dead_run, dead_started_ms} (dead_run 0: none).
--
-- 'row': write the row of run ARGV[3] unless it has one.
--   KEYS[2] window:<row window>:rows  KEYS[3] window:<row window>  KEYS[4] totals
--   KEYS[5] unverified:started
--   ARGV[2] member  ARGV[3] run  ARGV[4] row (JSON)  ARGV[5] outcome
--   ARGV[6] retention_s (the window's)  ARGV[7] totals field ('': none)  ARGV[8] ttl_s
--   ARGV[9] token (this call's: the same again after a lost reply is told it wrote the row)
--   Returns {1} when this call wrote the row, {0} when the run had it already (a table, as
--   every script on the worker's line answers: gatekeeper/redis/wire.py).

if ARGV[1] == 'start' then
  local held = redis.call('HMGET', KEYS[1], 't:' .. ARGV[5], 'runs')
  if ARGV[5] ~= '' and held[1] then  -- this start was applied already: its reply again
    local run, dead, dead_ms = string.match(held[1], '^(%d+)|(%d+)|(%d+)$')
    return {tonumber(run), tonumber(dead), dead_ms}
  end
  redis.call('HINCRBY', KEYS[2], 'unverified_runs', '1')
  local run = tonumber(held[2] or '0') + 1
  local dead, dead_ms = 0, '0'
  if ARGV[6] == '1' and run > 1 then
    local open = redis.call('HGET', KEYS[1], 'o:' .. (run - 1))
    if open then
      dead, dead_ms = run - 1, string.match(open, '^(%d+)')
    end
  end
  local fields = {'runs', run, 'o:' .. run, ARGV[3] .. '|' .. ARGV[7] .. '|' .. ARGV[8],
    't:' .. ARGV[5], run .. '|' .. dead .. '|' .. dead_ms}
  for i = 9, #ARGV do fields[#fields + 1] = ARGV[i] end
  redis.call('HSET', KEYS[1], unpack(fields))
  redis.call('HINCRBY', KEYS[1], 'open', '1')
  redis.call('EXPIRE', KEYS[1], ARGV[4])
  redis.call('ZADD', KEYS[3], ARGV[3], ARGV[2])
  return {run, dead, dead_ms}
end

local rowed = redis.call('HGET', KEYS[1], 'r:' .. ARGV[3])
if rowed then
  return {(rowed == ARGV[9] and ARGV[9] ~= '') and 1 or 0}
end
redis.call('HSET', KEYS[1], 'r:' .. ARGV[3], ARGV[9])
if redis.call('HDEL', KEYS[1], 'o:' .. ARGV[3]) == 1 then
  if redis.call('HINCRBY', KEYS[1], 'open', '-1') <= 0 then  -- no run of it left unrowed
    redis.call('ZREM', KEYS[5], ARGV[2])
  end
end
redis.call('EXPIRE', KEYS[1], ARGV[8])
redis.call('RPUSH', KEYS[2], ARGV[4])
redis.call('EXPIRE', KEYS[2], ARGV[6])
redis.call('HINCRBY', KEYS[3], 'unverified:' .. ARGV[5], '1')
redis.call('EXPIRE', KEYS[3], ARGV[6])
if ARGV[7] ~= '' then
  redis.call('HINCRBY', KEYS[4], ARGV[7], '1')
end
return {1}
