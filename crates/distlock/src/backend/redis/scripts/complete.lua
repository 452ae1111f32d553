-- Completes a once-lock: stores the record and releases the lock, only if the lock still holds
-- our token. A holder whose lease was lost stores nothing. The completing token is kept with
-- the record, so that a retry of a completion whose reply was lost (a failover, a dropped
-- connection) is recognised as done rather than refused.
--
-- KEYS[1]  lock key
-- KEYS[2]  state key
-- ARGV[1]  owner token
-- ARGV[2]  the record
-- ARGV[3]  retention of the record in milliseconds
--
-- Returns 1 if stored (now or by an earlier attempt with this token), 0 if the lock was not
-- ours any more.
if redis.pcall('GET', KEYS[1]) == ARGV[1] then
  redis.call('HSET', KEYS[2], 'd', ARGV[2], 'c', ARGV[1])
  redis.call('HDEL', KEYS[2], 'm')
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
  redis.call('DEL', KEYS[1])
  -- pcall: the write above has happened; a refused announcement (an ACL user without
  -- channel rights) must not turn it into an error. Waiters then poll.
  redis.pcall('PUBLISH', KEYS[1] .. ':rel', ARGV[1])
  return 1
end
if redis.call('HGET', KEYS[2], 'c') == ARGV[1] then
  return 1
end
return 0
