-- record.lua: a decision made in process (a guard, or the free path disabled): count it for
-- the review and write the gate's record of the attempt, in one round trip.
--
-- KEYS[1] window:<id>               hash: decided:<decision>:<reason>, review:* counters
-- KEYS[2] run:<job_id>:<attempt>    hash: the gate's record of this attempt (see gate.lua)
-- KEYS[3] run:<job_id>:<attempt-1>  the previous attempt's record (KEYS[2] again for attempt 1)
--
-- ARGV[1] decision   ARGV[2] reason   ARGV[3] defer_fit (0|1)   ARGV[4] reserved_age_shift (0|1)
-- ARGV[5] retention_s (the window's TTL)   ARGV[6] record_ttl_s
-- ARGV[7..] field, value pairs of the record (nonce, tokens_in, deadline_ms, ...)
--
-- Returns the record's free_admitted ('1' when an earlier attempt of the job was admitted).
-- With no record fields it only counts (a bad input: its row stays unverified).

if redis.call('HINCRBY', KEYS[1], 'decided:' .. ARGV[1] .. ':' .. ARGV[2], 1) == 1 then
  redis.call('EXPIRE', KEYS[1], tonumber(ARGV[5]))
end
if ARGV[3] == '1' then redis.call('HINCRBY', KEYS[1], 'review:defer_fit', 1) end
if ARGV[4] == '1' then redis.call('HINCRBY', KEYS[1], 'review:reserved_age_shift', 1) end
if #ARGV < 7 then return '0' end  -- counted only: no record (a bad input's row is unverified)
local free = '0'
if KEYS[3] ~= KEYS[2] and redis.call('HGET', KEYS[3], 'free_admitted') == '1' then
  free = '1'
end
local fields = {'decision', ARGV[1], 'reason', ARGV[2], 'window', '', 'free_admitted', free}
for i = 7, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[2], unpack(fields))
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[6]))
return free
