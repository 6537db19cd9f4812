-- fallback.lua: push a fast publish's message that gate.lua did not push (its script failed,
-- or its reply was lost), unless gate.lua, or an earlier try of this fallback, already pushed
-- it for this same publish request. The nonce tells the request apart from another publish of
-- the same task id and attempt, so a stalled gate.lua that runs after this, or this script
-- sent again, never pushes the message a second time.
--
-- KEYS[1] fast:<job_id>:<attempt>  "<nonce>|<decision>|<reason>" of the request that pushed
-- KEYS[2] the broker list to push to (kombu's name, priority sub-list included)
--
-- ARGV[1] nonce     ARGV[2] decision     ARGV[3] reason
-- ARGV[4] the message, JSON             ARGV[5] how long the key is kept, seconds
--
-- Returns nil when it pushed the message, else what KEYS[1] holds.

local done = redis.call('GET', KEYS[1])
if done and string.sub(done, 1, #ARGV[1] + 1) == ARGV[1] .. '|' then
  return done
end
redis.call('LPUSH', KEYS[2], ARGV[4])
redis.call('SET', KEYS[1], ARGV[1] .. '|' .. ARGV[2] .. '|' .. ARGV[3], 'EX', tonumber(ARGV[5]))
return false
