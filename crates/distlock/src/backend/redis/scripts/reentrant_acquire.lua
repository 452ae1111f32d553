-- Takes a reentrant lock: free, or already held by the same owner (then one more hold is added).
--
-- KEYS[1]  lock key: a hash with o = owner id, f = fence of the first hold, and one field
--          h:<hold token> per hold; the lease is its expiry
-- KEYS[2]  state key: a hash with n = fencing counter
-- ARGV[1]  owner id
-- ARGV[2]  lease in milliseconds
-- ARGV[3]  expiry of the state key in milliseconds, '0' to keep it
-- ARGV[4]  hold token (unique per acquisition, so that a release removes exactly one hold)
-- ARGV[5]  where a counter that expires starts when made again: the caller's clock, in
--          microseconds (from 0, it would repeat the fences given before it expired)
--
-- Returns {1, fence} when taken, {0, pttl} when held by another owner.
--
-- All or nothing: the fence is drawn before the lock is written, so a draw that fails (the
-- state key holds another type, the ACL user may not run HINCRBY) leaves nothing; a hash cannot
-- be written with its expiry in one command, so a hold whose lease cannot be set (PEXPIRE
-- refused) is taken back and the refusal returned: a lock without an expiry would be held by
-- nobody for ever.
local kind = redis.call('TYPE', KEYS[1]).ok
-- Whether a redis.pcall reply is a refusal (then returned as the script's error reply).
local function refused(reply)
  return type(reply) == 'table' and reply.err ~= nil
end
if kind == 'none' then
  if ARGV[3] ~= '0' then
    redis.call('HSETNX', KEYS[2], 'n', ARGV[5])
  end
  local fence = redis.call('HINCRBY', KEYS[2], 'n', '1')
  if ARGV[3] ~= '0' then
    redis.call('PEXPIRE', KEYS[2], ARGV[3])
  end
  redis.call('HSET', KEYS[1], 'o', ARGV[1], 'f', fence, 'h:' .. ARGV[4], '1')
  local expiry = redis.pcall('PEXPIRE', KEYS[1], ARGV[2])
  if refused(expiry) then
    redis.call('DEL', KEYS[1])
    return expiry
  end
  return {1, fence}
end
if kind == 'hash' and redis.call('HGET', KEYS[1], 'o') == ARGV[1] then
  redis.call('HSET', KEYS[1], 'h:' .. ARGV[4], '1')
  if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[2]) then
    local expiry = redis.pcall('PEXPIRE', KEYS[1], ARGV[2])
    if refused(expiry) then
      redis.call('HDEL', KEYS[1], 'h:' .. ARGV[4])
      return expiry
    end
  end
  return {1, tonumber(redis.call('HGET', KEYS[1], 'f'))}
end
return {0, redis.call('PTTL', KEYS[1])}
