-- fallback.lua: push a fast publish's message that gate.lua did not push (its script failed,
-- or its reply was lost), unless gate.lua, or an earlier try of this fallback, already pushed
-- it for this same publish request. The nonce tells the request apart from another publish of
-- the same task id and attempt, so a stalled gate.lua that runs after this, or this script
-- sent again, never pushes the message a second time.
--
-- KEYS[1] run:<job_id>:<attempt>  hash: the gate's record of the attempt (nonce, decision, ...)
-- KEYS[2] the broker list to push to (kombu's name, priority sub-list included)
-- KEYS[3] totals  hash: lifetime decided:<decision>:<reason>:<task> counters (counted here
--                 when this request pushes: the decision was not counted elsewhere)
--
-- ARGV[1] nonce     ARGV[2] decision     ARGV[3] reason
-- ARGV[4] the message, JSON             ARGV[5] how long the record is kept, seconds
-- ARGV[6] prev_nonce (the nonce a replayed attempt's message carries, else '')
-- ARGV[7] task (the label the totals count it under)
-- ARGV[8..] field, value pairs of the record (what the caller knows of the attempt)
--
-- As in gate.lua, a live record of another publish of the attempt is left alone (the
-- message is pushed all the same, and runs unpriced).
--
-- Returns false when it pushed the message, else {decision, reason} of the push this request
-- already made.

local done = redis.call('HMGET', KEYS[1], 'nonce', 'decision', 'reason', 'runs', 'rowed',
  'dup:' .. ARGV[1], 'abandoned')
if done[1] == ARGV[1] then
  return {done[2], done[3]}
end
if done[6] then  -- pushed already as a duplicate of a live record
  return {string.match(done[6], '^([^|]*)|(.*)$')}
end
redis.call('LPUSH', KEYS[2], ARGV[4])
if redis.call('HINCRBY', KEYS[3], 'decided:' .. ARGV[2] .. ':' .. ARGV[3] .. ':' .. ARGV[7], 1)
    == 1 then  -- a new counter: `hash_table` with it, as gate.lua writes it
  redis.call('HSET', KEYS[3], 'hash_table',
    '00000000000000000000000000000000000000000000000000000000000000000')
end
local runs, rowed = tonumber(done[4] or '0'), tonumber(done[5] or '0')
if done[1] and done[1] ~= ARGV[6] and (runs == 0 or rowed < runs) and not done[7] then
  redis.call('HSET', KEYS[1], 'dup:' .. ARGV[1], ARGV[2] .. '|' .. ARGV[3])
  return false
end
if (done[4] or done[5]) and done[1] ~= ARGV[6] then  -- a reused id after its row: anew
  redis.call('HDEL', KEYS[1], 'runs', 'rowed', 'owed', 'charged', 'missed')  -- (as gate.lua does)
end
if done[7] then  -- an abandoned attempt live again (as gate.lua)
  redis.call('HDEL', KEYS[1], 'abandoned', 'missed')
end
local fields = {'nonce', ARGV[1], 'decision', ARGV[2], 'reason', ARGV[3]}
for i = 8, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[5]))
return false
