-- pair.lua: keep a deciding process's pair of values (gatekeeper/redis/deployment.py), with
-- when it was first and last seen across every process that shares it, whatever their clocks
-- (the earliest first, the latest last: a host whose clock is behind moves neither back).
--
-- KEYS[1] deployment  hash: <window_seconds>|<budget_units> ->
--                     <first seen>|<last seen>|<host>:<pid> (Unix seconds; the writer of last)
--
-- ARGV[1] field  <window_seconds>|<budget_units>
-- ARGV[2] now    Unix seconds, the writer's clock
-- ARGV[3] by     <host>:<pid>
--
-- Returns the hash after the write (HGETALL).

local now = tonumber(ARGV[2])
local first, last, by = now, now, ARGV[3]
local was = redis.call('HGET', KEYS[1], ARGV[1])
if was then
  local f, l, b = string.match(was, '^([^|]*)|([^|]*)|(.*)$')
  f, l = tonumber(f), tonumber(l)
  if f and f < first then first = f end
  if l and l > last then last, by = l, b end
end
redis.call('HSET', KEYS[1], ARGV[1],
  string.format('%.17g', first) .. '|' .. string.format('%.17g', last) .. '|' .. by)
return redis.call('HGETALL', KEYS[1])
