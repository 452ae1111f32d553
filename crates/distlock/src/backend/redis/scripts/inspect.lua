-- Reads what the store holds for a name, changing nothing: the lock's lease, and the run-once
-- state (fencing counter, the holder's tag and since when it holds, the record's first part
-- and part count, how long the state is kept).
--
-- KEYS[1]  lock key
-- KEYS[2]  state key
-- KEYS[3]  parts key
--          All keys share one {hash tag}.
--
-- Returns {lock PTTL (-2: no lock, -1: no expiry), n, m, t, first part, parts, state PTTL},
-- with false for what is absent; parts is 0 without a record, and m is false with one (a
-- completed record keeps its completing token there, not a holder's tag: complete.lua).
local s = redis.call('HMGET', KEYS[2], 'n', 'm', 't', 'd', 'p')
local first = s[4]
local parts = 0
if first then
  parts = 1
elseif s[5] then
  first = redis.call('LINDEX', KEYS[3], '0')
  parts = tonumber(s[5])
end
local tag = s[2] or false
if parts > 0 then
  tag = false
end
return {redis.call('PTTL', KEYS[1]), s[1] or false, tag, s[3] or false, first or false,
  parts, redis.call('PTTL', KEYS[2])}
