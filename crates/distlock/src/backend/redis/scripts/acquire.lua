-- Takes an exclusive lock if it is free, atomically with its fencing counter.
--
-- KEYS[1]  lock key: a string holding the owner token, with the lease as its expiry
-- KEYS[2]  state key: a hash with n = fencing counter, and for a once-lock m = the holder's tag
--          and d = the completion record. Both keys share one {hash tag}.
-- ARGV[1]  owner token (unique per acquisition)
-- ARGV[2]  lease in milliseconds
-- ARGV[3]  expiry of the state key in milliseconds, '0' to keep it
-- ARGV[4]  'x' for an exclusive lock, 'o' for a once-lock
-- ARGV[5]  the holder's tag (once-lock)
--
-- Returns {1, fence} when taken, {0, pttl[, tag]} when held by another owner,
-- {2, record} when a once-lock was already completed.
local once = ARGV[4] == 'o'
if once then
  local done = redis.call('HGET', KEYS[2], 'd')
  if done then
    return {2, done}
  end
end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local fence = redis.call('HINCRBY', KEYS[2], 'n', 1)
  if once then
    redis.call('HSET', KEYS[2], 'm', ARGV[5])
  end
  if ARGV[3] ~= '0' then
    redis.call('PEXPIRE', KEYS[2], ARGV[3])
  end
  return {1, fence}
end
local pttl = redis.call('PTTL', KEYS[1])
if once then
  return {0, pttl, redis.call('HGET', KEYS[2], 'm') or ''}
end
return {0, pttl}
