-- Renews the lease only if the lock still holds our token (compare-and-pexpire).
--
-- KEYS[1]  lock key
-- KEYS[2]  state key
-- KEYS[3]  (once-locks) parts key: it lives as long as the state
-- ARGV[1]  owner token
-- ARGV[2]  new lease in milliseconds
-- ARGV[3]  expiry of the state key in milliseconds, '0' to keep it
--
-- Returns 1 if renewed, 0 if the lock is not ours any more.
if redis.pcall('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  if ARGV[3] ~= '0' then
    redis.call('PEXPIRE', KEYS[2], ARGV[3])
    if KEYS[3] then
      redis.call('PEXPIRE', KEYS[3], ARGV[3])
    end
  end
  return 1
end
return 0
