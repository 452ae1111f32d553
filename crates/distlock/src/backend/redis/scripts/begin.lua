-- Begins a once-lock: returns its completion record if it was completed, else takes it if it
-- is free (with its fencing counter, storing the holder's tag), else reports the holder.
--
-- KEYS[1]  lock key: a string holding the owner token, with the lease as its expiry
-- KEYS[2]  state key: a hash with n = fencing counter, m = the holder's tag, d = the completion
--          record, c = the token that completed it. Both keys share one {hash tag}.
-- ARGV[1]  owner token (unique per attempt)
-- ARGV[2]  lease in milliseconds
-- ARGV[3]  expiry of the state key (the record retention) in milliseconds
-- ARGV[4]  the holder's tag (e.g. a request fingerprint), shown to contenders
--
-- Returns {2, record} when completed, {1, fence} when taken, {0, pttl, tag} when held.
local done = redis.call('HGET', KEYS[2], 'd')
if done then
  return {2, done}
end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local fence = redis.call('HINCRBY', KEYS[2], 'n', 1)
  redis.call('HSET', KEYS[2], 'm', ARGV[4])
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
  return {1, fence}
end
return {0, redis.call('PTTL', KEYS[1]), redis.call('HGET', KEYS[2], 'm') or ''}
