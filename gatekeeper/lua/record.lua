-- record.lua: a decision made in process (a guard, or the free path disabled): count it for
-- the review and write the gate's record of the attempt, in one round trip.
--
-- KEYS[1] window:<id>               hash: decided:<decision>:<reason>, review:* counters
-- KEYS[2] run:<job_id>:<attempt>    hash: the gate's record of this attempt (see gate.lua)
-- KEYS[3] run:<job_id>:<attempt-1>  the previous attempt's record (KEYS[2] again for attempt 1)
-- KEYS[4] totals                   hash: lifetime decided:<decision>:<reason>:<task> counters
-- KEYS[5] deferred                 sorted set: deferred attempts by deadline (see gate.lua)
-- KEYS[6] decisions                stream: the decision records (see gate.lua)
--
-- ARGV[1] decision   ARGV[2] reason   ARGV[3] defer_fit (0|1)   ARGV[4] reserved_age_shift (0|1)
-- ARGV[5] retention_s (the window's TTL)   ARGV[6] record_ttl_s
-- ARGV[7] prev_nonce (the nonce a replayed attempt's message carries, else '')
-- ARGV[8] task (the label the totals count it under)   ARGV[9] deferred_cap
-- ARGV[10] member <job_id>:<attempt>
-- ARGV[11] record_cap (how many decision records to keep, about; '0': none)
-- ARGV[12..28] the decision record's values, in gatekeeper/core/whatif.py FIELDS order (the
--              Python side knows them all: no queue age, tax or exposure was read, so '')
-- ARGV[29..] field, value pairs of the record (nonce, tokens_in, deadline_ms, ...)
--
-- Returns the record's free_admitted ('1' when an earlier attempt of the job was admitted),
-- or 'unrecorded': no record fields (a bad input: its row stays unverified), or another
-- publish of the attempt holds a live record (as in gate.lua, it is left alone).

-- Sent again (a lost reply): the record already holds this request's nonce, so it was
-- counted and written; answer as then, change nothing.
local FIELDS = {'d', 'r', 'j', 'k', 'a', 's', 'x', 'l', 'y', 'n', 'c', 'b', 'u', 'm', 'tu', 'e',
  'p'}
local deadline
for i = 29, #ARGV - 1, 2 do
  if ARGV[i] == 'nonce' then
    local held = redis.call('HMGET', KEYS[2], 'nonce', 'free_admitted')
    if held[1] == ARGV[i + 1] then return held[2] or '0' end
  elseif ARGV[i] == 'deadline_ms' then
    deadline = ARGV[i + 1]
  end
end
-- A new counter also writes `hash_table` (gate.lua's WIDE), so that a window or the totals
-- this script creates (a night with the free path off) is a hash table too, as gate.lua's.
local WIDE = '00000000000000000000000000000000000000000000000000000000000000000'
if redis.call('HINCRBY', KEYS[1], 'decided:' .. ARGV[1] .. ':' .. ARGV[2], 1) == 1 then
  redis.call('EXPIRE', KEYS[1], tonumber(ARGV[5]))
  redis.call('HSET', KEYS[1], 'hash_table', WIDE)
end
if redis.call('HINCRBY', KEYS[4], 'decided:' .. ARGV[1] .. ':' .. ARGV[2] .. ':' .. ARGV[8], 1)
    == 1 then
  redis.call('HSET', KEYS[4], 'hash_table', WIDE)
end
if ARGV[1] == 'defer' and deadline then
  redis.call('ZADD', KEYS[5], deadline, ARGV[10])
  redis.call('ZREMRANGEBYRANK', KEYS[5], tonumber(ARGV[9]), -1)
end
if ARGV[3] == '1' then redis.call('HINCRBY', KEYS[1], 'review:defer_fit', 1) end
if ARGV[4] == '1' then redis.call('HINCRBY', KEYS[1], 'review:reserved_age_shift', 1) end
if tonumber(ARGV[11]) > 0 then
  local entry = {}
  for i, name in ipairs(FIELDS) do
    entry[#entry + 1] = name
    entry[#entry + 1] = ARGV[11 + i]
  end
  local kept = redis.pcall('XADD', KEYS[6], 'MAXLEN', '~', ARGV[11], '*', unpack(entry))
  if type(kept) == 'table' and kept.err then  -- best effort, as in gate.lua
    redis.call('HINCRBY', KEYS[4], 'records_refused', 1)
  end
end
if #ARGV < 29 then return 'unrecorded' end  -- counted only (a bad input's row is unverified)
local held = redis.call('HMGET', KEYS[2], 'nonce', 'runs', 'rowed', 'abandoned')
local runs, rowed = tonumber(held[2] or '0'), tonumber(held[3] or '0')
if held[1] and held[1] ~= ARGV[7] and (runs == 0 or rowed < runs) and not held[4] then
  return 'unrecorded'
end
if (held[2] or held[3]) and held[1] ~= ARGV[7] then  -- a reused id after its row: anew
  redis.call('HDEL', KEYS[2], 'runs', 'rowed', 'owed', 'charged', 'missed')  -- (as gate.lua does)
end
if held[4] then  -- an abandoned attempt live again (as gate.lua)
  redis.call('HDEL', KEYS[2], 'abandoned', 'missed')
end
local free = '0'
if KEYS[3] ~= KEYS[2] and redis.call('HGET', KEYS[3], 'free_admitted') == '1' then
  free = '1'
end
local fields = {'decision', ARGV[1], 'reason', ARGV[2], 'window', '', 'free_admitted', free,
  'label', ARGV[8], 'prev_nonce', ARGV[7]}  -- as gate.lua: a replay's message, scored
for i = 29, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[2], unpack(fields))
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[6]))
return free
