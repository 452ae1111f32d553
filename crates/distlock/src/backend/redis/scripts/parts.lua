-- Reads a once-lock's record: up to ARGV[3] parts from index ARGV[1] on, with the record's
-- state and its writer's fence, in one atomic step (read only).
--
-- KEYS[1]  lock key
-- KEYS[2]  state key
-- KEYS[3]  parts key. All keys share one {hash tag}.
-- ARGV[1]  first index (0-based)
-- ARGV[2]  last index (ARGV[1] + ARGV[3] - 1)
-- ARGV[3]  how many parts at most, '0' for none (the state only)
--
-- Returns {state, fence, parts, stored, pttl, {part, ...}}: state 2 = done (parts = its part
-- count, stored = the list's length for a streamed record), 1 = being written by a live holder
-- (parts = appended so far, pttl = its remaining lease), 0 = abandoned (no holder, no record).
-- The fence is the counter, which is the current (or last) holder's.
local state = redis.call('HMGET', KEYS[2], 'n', 'd', 'p')
local fence = tonumber(state[1]) or 0
local function range()
  if ARGV[3] == '0' then
    return {}
  end
  return redis.call('LRANGE', KEYS[3], ARGV[1], ARGV[2])
end
if state[2] then
  if ARGV[1] == '0' and ARGV[3] ~= '0' then
    return {2, fence, 1, 1, -1, {state[2]}}
  end
  return {2, fence, 1, 1, -1, {}}
end
if state[3] then
  return {2, fence, tonumber(state[3]), redis.call('LLEN', KEYS[3]), -1, range()}
end
local pttl = redis.call('PTTL', KEYS[1])
if pttl == -2 then
  return {0, fence, 0, 0, -1, {}}
end
local stored = redis.call('LLEN', KEYS[3])
return {1, fence, stored, stored, pttl, range()}
