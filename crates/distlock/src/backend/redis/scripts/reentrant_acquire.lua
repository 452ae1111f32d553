-- Takes a reentrant lock: free, or already held by the same owner (then one more hold is added).
--
-- KEYS[1]  lock key: a hash with o = owner id, f = fence of the first hold, and one field
--          h:<hold token> per hold; the lease is its expiry
-- KEYS[2]  state key: a hash with n = fencing counter
-- ARGV[1]  owner id
-- ARGV[2]  lease in milliseconds
-- ARGV[3]  expiry of the state key in milliseconds, '0' to keep it
-- ARGV[4]  hold token (unique per acquisition, so that a release removes exactly one hold)
--
-- Returns {1, fence} when taken, {0, pttl} when held by another owner.
local kind = redis.call('TYPE', KEYS[1]).ok
if kind == 'none' then
  local fence = redis.call('HINCRBY', KEYS[2], 'n', '1')
  if ARGV[3] ~= '0' then
    redis.call('PEXPIRE', KEYS[2], ARGV[3])
  end
  redis.call('HSET', KEYS[1], 'o', ARGV[1], 'f', fence, 'h:' .. ARGV[4], '1')
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {1, fence}
end
if kind == 'hash' and redis.call('HGET', KEYS[1], 'o') == ARGV[1] then
  redis.call('HSET', KEYS[1], 'h:' .. ARGV[4], '1')
  if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[2]) then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
  end
  return {1, tonumber(redis.call('HGET', KEYS[1], 'f'))}
end
return {0, redis.call('PTTL', KEYS[1])}
