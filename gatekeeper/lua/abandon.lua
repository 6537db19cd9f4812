-- abandon.lua: the `abandoned` row of a deferred attempt whose deadline passed, written once.
--
-- KEYS[1] abandoned:<job_id>:<attempt>  string marker: '1' once the attempt has its row
--                                       (without ARGV[6]: an older caller's way)
-- KEYS[2] window:<id>                   hash: rows:abandoned, slack_misses, admitted_free
-- KEYS[3] window:<id>:rows              list: ledger rows (JSON)
-- KEYS[4] totals                        hash: lifetime abandoned, slack_misses (never expire)
-- KEYS[5] decisions                     stream: the decision records; a slack miss adds an
--                                       entry `miss` = ARGV[4] (unless ARGV[5] is 0)
-- KEYS[6] run:<job_id>:<attempt>        hash: the gate's record of the attempt
-- KEYS[7] abandoned:<job_id>:<attempt>:<nonce>  string marker: this message's row is written
-- KEYS[8] run:<job_id>:<admitting attempt>  the record of the free admission a miss belongs
--                                       to (gatekeeper/redis/owner.py): `missed`, once
-- KEYS[9] window:<id>                   hash: slack_misses, admitted_free of the admission's
--                                       window, which counts the miss (KEYS[2] when unknown)
--
-- ARGV[1] row           JSON (built by the Python core: no tokens, no wait charge)
-- ARGV[2] retention_s
-- ARGV[3] slack_miss    1 when an earlier attempt of the job was admitted to the free path
-- ARGV[4] member        <job_id>:<attempt>
-- ARGV[5] record_cap    how many decision records to keep (about); '0': none
-- ARGV[6] nonce         the abandoned message's (an older replayer sends none)
--
-- Returns {written (0|1), slack_misses, admitted_free} of the window that counts a miss, and
-- when written, missed (1 when this row counted the miss).

local marker = KEYS[1]
if ARGV[6] then
  -- Only the message of the record's nonce: a copy of an earlier decision (the task id was
  -- published again after it ended, or requeued) is not the attempt's now: no row.
  if redis.call('HGET', KEYS[6], 'nonce') ~= ARGV[6] then
    return {0, 0, 0}
  end
  -- The abandonment ends the attempt as a run's row does: a publish of the task id after it
  -- is not a duplicate of a live one, but starts the attempt again (gate.lua, record.lua,
  -- fallback.lua), as does a dead-letter requeue. Each abandoned message (its nonce: one
  -- decision) is rowed once, so each of those lives' abandonment is rowed, and a copy of
  -- one (a twin, or one a killed replayer left in defer) is not rowed again, here or as a
  -- stranger's (the replayer asks this marker: RunLedger.abandoned_before).
  -- (An older version's marker, per attempt, is not read: it would refuse the row of every
  -- later life of the attempt for its eight days; a copy of a message that version rowed,
  -- abandoned after the upgrade, is rowed again.)
  redis.call('HSET', KEYS[6], 'abandoned', '1')
  marker = KEYS[7]
end
if not redis.call('SET', marker, '1', 'NX', 'EX', tonumber(ARGV[2])) then
  return {0, 0, 0}
end
redis.call('RPUSH', KEYS[3], ARGV[1])
redis.call('EXPIRE', KEYS[3], tonumber(ARGV[2]))
redis.call('HINCRBY', KEYS[2], 'rows:abandoned', 1)
redis.call('HINCRBY', KEYS[4], 'abandoned', 1)
local counts = KEYS[9] or KEYS[2]
-- One miss per free admission, as in finish.lua: not when its job's end counted it already.
local missed = ARGV[3] == '1' and not (KEYS[8] and redis.call('EXISTS', KEYS[8]) == 1
  and redis.call('HSETNX', KEYS[8], 'missed', ARGV[4]) == 0)
if missed then
  redis.call('HINCRBY', counts, 'slack_misses', 1)
  redis.call('EXPIRE', counts, tonumber(ARGV[2]))
  redis.call('HINCRBY', KEYS[4], 'slack_misses', 1)
  if tonumber(ARGV[5]) > 0 then  -- best effort, as in gate.lua
    local kept = redis.pcall('XADD', KEYS[5], 'MAXLEN', '~', ARGV[5], '*', 'miss', ARGV[4])
    if type(kept) == 'table' and kept.err then
      redis.call('HINCRBY', KEYS[4], 'records_refused', 1)
    end
  end
end
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[2]))
local misses = tonumber(redis.call('HGET', counts, 'slack_misses') or '0')
local admitted = tonumber(redis.call('HGET', counts, 'admitted_free') or '0')
return {1, misses, admitted, missed and 1 or 0}
