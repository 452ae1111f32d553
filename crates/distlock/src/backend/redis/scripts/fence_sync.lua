-- Redlock: raises this node's fencing counter to the fence chosen from the quorum (the largest
-- of the nodes' counters), only while the lock on this node is still ours. Sent before the lock
-- is used when fewer than a quorum of nodes drew that fence (every later quorum then shares a
-- node with the nodes recording it, so the next holder draws a larger fence), else in the
-- background to the nodes that lag. Only ever raises: a late call does no harm.
--
-- KEYS[1]  lock key
-- KEYS[2]  state key
-- ARGV[1]  owner token (exclusive and once-locks) or owner id (reentrant locks)
-- ARGV[2]  the fence
-- ARGV[3]  'x' for exclusive and once-locks, 'r' for reentrant locks
--
-- Returns 1 if the lock is ours here and the counter is at least the fence, else 0.
local mine
if ARGV[3] == 'r' then
  mine = redis.call('TYPE', KEYS[1]).ok == 'hash' and redis.call('HGET', KEYS[1], 'o') == ARGV[1]
else
  mine = redis.pcall('GET', KEYS[1]) == ARGV[1]
end
if not mine then
  return 0
end
local fence = tonumber(ARGV[2])
if (tonumber(redis.call('HGET', KEYS[2], 'n')) or 0) < fence then
  -- ARGV[2], the integer as sent, not the Lua number: written back digit for digit.
  redis.call('HSET', KEYS[2], 'n', ARGV[2])
end
-- A reentrant hold records its fence (re-entries return it). Raised, never lowered: a raise sent
-- in the background can land after the same owner released and took the lock again with a
-- larger fence.
if ARGV[3] == 'r' and (tonumber(redis.call('HGET', KEYS[1], 'f')) or 0) < fence then
  redis.call('HSET', KEYS[1], 'f', ARGV[2])
end
return 1
