-- pair.lua: keep a process's pair of values (gatekeeper/redis/deployment.py), last seen now by
-- the server's clock (one clock for every host: none moves a pair back or pins it ahead).
--
-- KEYS[1] deployment  hash: <window_seconds>|<budget_units, or rows> ->
--                     <last seen, Unix s>|<host>:<pid>
--
-- ARGV[1] field  <window_seconds>|<budget_units, or rows>
-- ARGV[2] by     <host>:<pid>
--
-- Returns the server's time (Unix s), then the hash after the write (HGETALL's pairs).

local time = redis.call('TIME')
local now = string.format('%d.%06d', time[1], time[2])
redis.call('HSET', KEYS[1], ARGV[1], now .. '|' .. ARGV[2])
local reply = redis.call('HGETALL', KEYS[1])
table.insert(reply, 1, now)
return reply
