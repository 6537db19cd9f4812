-- abandon.lua: the `abandoned` row of a deferred attempt whose deadline passed, written once.
--
-- KEYS[1] abandoned:<job_id>:<attempt>  string marker: '1' once the attempt has its row; the
--                                       nonce of its abandoned message once a publish of
--                                       the task id started the attempt again (gate.lua)
-- KEYS[2] window:<id>                   hash: rows:abandoned, slack_misses, admitted_free
-- KEYS[3] window:<id>:rows              list: ledger rows (JSON)
-- KEYS[4] totals                        hash: lifetime abandoned, slack_misses (never expire)
-- KEYS[5] decisions                     stream: the decision records; a slack miss adds an
--                                       entry `miss` = ARGV[4] (unless ARGV[5] is 0)
-- KEYS[6] run:<job_id>:<attempt>        hash: the gate's record of the attempt
--
-- ARGV[1] row           JSON (built by the Python core: no tokens, no wait charge)
-- ARGV[2] retention_s
-- ARGV[3] slack_miss    1 when an earlier attempt of the job was admitted to the free path
-- ARGV[4] member        <job_id>:<attempt>
-- ARGV[5] record_cap    how many decision records to keep (about); '0': none
-- ARGV[6] nonce         the abandoned message's (an older replayer sends none)
--
-- Returns {written (0|1), slack_misses, admitted_free} of the window.

if ARGV[6] then
  -- Only the message of the record's nonce: a copy of an earlier life (the task id was
  -- published again after it ended) is not this attempt's now, and writes nothing.
  if redis.call('HGET', KEYS[6], 'nonce') ~= ARGV[6] then
    return {0, 0, 0}
  end
  -- The abandonment ends the attempt as a run's row does: a publish of the task id after it
  -- is not a duplicate of a live one, but starts the attempt again (gate.lua, record.lua,
  -- fallback.lua). Marked again when a replay revived it (a dead-letter requeue) and it is
  -- abandoned once more, which writes no second row.
  redis.call('HSET', KEYS[6], 'abandoned', '1')
end
-- Once per life of the attempt: '1' is this life's row (a nonce: an earlier life's).
if redis.call('GET', KEYS[1]) == '1' then
  return {0, 0, 0}
end
redis.call('SET', KEYS[1], '1', 'EX', tonumber(ARGV[2]))
redis.call('RPUSH', KEYS[3], ARGV[1])
redis.call('EXPIRE', KEYS[3], tonumber(ARGV[2]))
redis.call('HINCRBY', KEYS[2], 'rows:abandoned', 1)
redis.call('HINCRBY', KEYS[4], 'abandoned', 1)
if ARGV[3] == '1' then
  redis.call('HINCRBY', KEYS[2], 'slack_misses', 1)
  redis.call('HINCRBY', KEYS[4], 'slack_misses', 1)
  if tonumber(ARGV[5]) > 0 then  -- best effort, as in gate.lua
    local kept = redis.pcall('XADD', KEYS[5], 'MAXLEN', '~', ARGV[5], '*', 'miss', ARGV[4])
    if type(kept) == 'table' and kept.err then
      redis.call('HINCRBY', KEYS[4], 'records_refused', 1)
    end
  end
end
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[2]))
local misses = tonumber(redis.call('HGET', KEYS[2], 'slack_misses') or '0')
local admitted = tonumber(redis.call('HGET', KEYS[2], 'admitted_free') or '0')
return {1, misses, admitted}
