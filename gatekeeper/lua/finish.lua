-- finish.lua: write the one ledger row of a run, charge its tax, release its exposure.
--
-- Idempotent per run: a signal that fires twice, or a retried write, finds `rowed` already
-- at this run and changes nothing. The row itself is built by the caller from the Python core
-- (gatekeeper/ledger.py make_row); this script only applies it atomically.
--
-- KEYS[1] run:<job_id>:<attempt>   hash: rowed = the last run that has its row
-- KEYS[2] window:<row window>       hash: tax_units, rows:<outcome>, killed_free
-- KEYS[3] window:<row window>:rows  list: ledger rows (JSON)
-- KEYS[4] inflight                  hash: <job_id>:<attempt> -> "<tokens>|<window>|<ms>"
-- KEYS[5] started                   sorted set: runs started without a row
-- KEYS[6] window:<admission window> hash: exposure, admitted_free, slack_misses
--
-- ARGV[1] member        <job_id>:<attempt>
-- ARGV[2] run           the run this row belongs to
-- ARGV[3] row           JSON
-- ARGV[4] outcome       ok | killed
-- ARGV[5] path          free | reserved
-- ARGV[6] retry_tax     this row's tax (charged to tax_units on the free path only)
-- ARGV[7] slack_miss    1 when a free-admitted job finished after its deadline
-- ARGV[8] retention_s   TTL of the window's keys
-- ARGV[9] current       1 when this run is the attempt's latest start (it leaves `started`)
--
-- Returns {written (0|1), admission window's slack_misses, admission window's admitted_free}.

local run = tonumber(ARGV[2])
local rowed = tonumber(redis.call('HGET', KEYS[1], 'rowed') or '0')
if rowed >= run then
  return {0, 0, 0}
end
redis.call('HSET', KEYS[1], 'rowed', run)
redis.call('RPUSH', KEYS[3], ARGV[3])
redis.call('EXPIRE', KEYS[3], tonumber(ARGV[8]))
redis.call('HINCRBY', KEYS[2], 'rows:' .. ARGV[4], 1)
if ARGV[5] == 'free' then
  redis.call('HINCRBYFLOAT', KEYS[2], 'tax_units', ARGV[6])
  if ARGV[4] == 'killed' then
    redis.call('HINCRBY', KEYS[2], 'killed_free', 1)
  end
end
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[8]))
local held = redis.call('HGET', KEYS[4], ARGV[1])
if held then
  redis.call('HDEL', KEYS[4], ARGV[1])
  redis.call('HINCRBYFLOAT', KEYS[6], 'exposure', -tonumber(string.match(held, '^[^|]+')))
end
if ARGV[7] == '1' then
  redis.call('HINCRBY', KEYS[6], 'slack_misses', 1)
  redis.call('EXPIRE', KEYS[6], tonumber(ARGV[8]))
end
if ARGV[9] == '1' then
  redis.call('ZREM', KEYS[5], ARGV[1])
end
local misses = tonumber(redis.call('HGET', KEYS[6], 'slack_misses') or '0')
local admitted = tonumber(redis.call('HGET', KEYS[6], 'admitted_free') or '0')
return {1, misses, admitted}
