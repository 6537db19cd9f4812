-- start.lua: a worker started a run of a gated attempt.
--
-- The message is the gate's only when it carries the nonce of the gate's record of the
-- attempt (written by gate.lua, record.lua or fallback.lua when it was decided): a caller
-- chooses task ids and headers, so neither proves anything. A message without a nonce (a
-- publisher that predates records, or a decision made without Redis) is counted as
-- unverified; one whose nonce is not the record's is counted as forged; neither touches the
-- record, the started set or the free queue's wait. One with a nonce and no record at all
-- (a failover lost what the old master had not replicated; the record expired; only what a
-- row written after the loss left, with no nonce) is answered
-- unverified, not counted here: the caller counts its run as an unverified one
-- (unverified.lua), with the unverified row it is owed. A forger gains nothing by it: leaving
-- the nonce out gets the same row.
--
-- For the gate's message: counts the run, adds what the worker knows of it to the record,
-- marks it started (for the sweep) and drops the attempt from the free queue's waiting set.
-- When an earlier run of the same attempt never got its row (its worker died and the broker
-- redelivered the message), that run's start time is returned, so the caller can record it
-- as killed.
--
-- Safe to send twice: each start carries a random token, kept in the record with what the
-- start replied (`start_token`, `start_dead`). The same token again (a request re-sent after
-- a lost reply) gets the same reply and changes nothing, so a re-sent start never counts a
-- second run, which would make the first look dead and get a false `killed` row. (A refused
-- message's counter in `stats` is not guarded: it prices nothing.)
--
-- KEYS[1] run:<job_id>:<attempt>   hash: the gate's record, then runs, rowed, started_ms,
--                                  start_token, start_dead and the worker's fields below
-- KEYS[2] started                   sorted set: <job_id>:<attempt> -> start time (ms)
-- KEYS[3] free:waiting              sorted set: admitted free attempts not yet started
-- KEYS[4] stats                     hash: unverified_runs, forged_runs, reruns_after_row (a run
--                                   of an attempt that already had its row: the broker
--                                   delivered a finished message again, or a requeued
--                                   `Reject`'s copy)
--
-- ARGV[1] member          <job_id>:<attempt>
-- ARGV[2] now_ms
-- ARGV[3] nonce           the message's gatekeeper_nonce ('' when it has none)
-- ARGV[4] token           this start's random value ('': not guarded against a re-send)
-- ARGV[5..] field, value pairs the worker knows itself: task, worker, and `own`, its
--            retries, max_retries, time_limit_s and tokens_out as one (gatekeeper/redis/kept.py)
--
-- Returns {0, 'unverified' | 'forged'} for a message that is not the gate's ({0,
-- 'unverified', 'none'} for one with a nonce and no record: not counted), else
-- {1, run, dead_run, dead_started_ms, field, value, ...}: dead_run is 0 when no earlier run is
-- missing its row; the fields are the gate's of the record (GATE below, those it has), not
-- those the caller sent (ARGV[2], ARGV[5..]), which it adds itself.

local held = redis.call('HMGET', KEYS[1], 'nonce', 'start_token', 'start_dead', 'runs', 'rowed',
  'started_ms')
if ARGV[3] == '' or held[1] ~= ARGV[3] then
  -- No nonce in the record: no record at all, or what another run's late row left of a record
  -- Redis lost (finish.lua's rowed and rowed_by: a kept row sent again once Redis answered,
  -- empty). The gate, record.lua and fallback.lua always write a nonce.
  if ARGV[3] ~= '' and not held[1] then
    return {0, 'unverified', 'none'}
  end
  local kind = ARGV[3] == '' and 'unverified' or 'forged'
  redis.call('HINCRBY', KEYS[4], kind .. '_runs', '1')
  return {0, kind}
end
-- The gate's fields of the record, those a row needs (the caller has the rest: what it sent).
-- Read by name: the whole record (HGETALL) came back as some 50 strings, converted to Lua
-- and back, most of them the caller's own (bench/worker_ir.py).
local GATE = {'decision', 'published_ms', 'admitted_ms', 'window', 'deadline_ms', 'tokens_in',
  'dwell_s', 'free_admitted', 'reserved', 'kept'}
local function with_record(reply)
  local values = redis.call('HMGET', KEYS[1], unpack(GATE))
  for i = 1, #GATE do
    if values[i] then
      reply[#reply + 1] = GATE[i]
      reply[#reply + 1] = values[i]
    end
  end
  return reply
end
if ARGV[4] ~= '' and held[2] == ARGV[4] then  -- this start was applied already
  local dead, dead_ms = string.match(held[3] or '0|0', '^([^|]*)|(.*)$')
  return with_record({1, tonumber(held[4]), tonumber(dead), dead_ms})
end
local run = tonumber(held[4] or '0') + 1
local rowed = tonumber(held[5] or '0')
local reply = {1, run, 0, '0'}
if run > 1 and rowed >= run - 1 then
  redis.call('HINCRBY', KEYS[4], 'reruns_after_row', '1')
end
if run > 1 and rowed < run - 1 then
  reply[3] = run - 1
  reply[4] = held[6] or '0'
end
local fields = {'runs', run, 'started_ms', ARGV[2], 'start_token', ARGV[4],
  'start_dead', reply[3] .. '|' .. reply[4]}
for i = 5, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
return with_record(reply)
