-- Removes one hold of a reentrant lock; the last hold deletes the lock and announces the release.
--
-- KEYS[1]  lock key
-- ARGV[1]  owner id
-- ARGV[2]  hold token
--
-- Returns 1 if the hold was ours and is removed, 0 otherwise (nothing is touched).
if redis.call('TYPE', KEYS[1]).ok == 'hash'
    and redis.call('HGET', KEYS[1], 'o') == ARGV[1]
    and redis.call('HDEL', KEYS[1], 'h:' .. ARGV[2]) == 1 then
  -- o and f are the only fields left when no hold remains.
  if redis.call('HLEN', KEYS[1]) <= 2 then
    redis.call('DEL', KEYS[1])
    -- pcall: the write above has happened; a refused announcement (an ACL user without
    -- channel rights) must not turn it into an error. Waiters then poll.
    redis.pcall('PUBLISH', KEYS[1] .. ':rel', ARGV[2])
  end
  return 1
end
return 0
