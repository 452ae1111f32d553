-- Deletes the lock only if it still holds our token (compare-and-delete), then announces the
-- release (with the token, so a waiter hearing it from several Redlock nodes wakes once)
-- so that waiters wake up instead of polling.
--
-- KEYS[1]  lock key
-- KEYS[2]  (once-locks) parts key: what was appended goes with the lock (no record)
-- ARGV[1]  owner token
--
-- Returns 1 if the lock was ours and is now deleted, 0 if it was not ours (expired, or taken by
-- someone else after it expired): then nothing is touched.
if redis.pcall('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  if KEYS[2] then
    redis.call('DEL', KEYS[2])
  end
  -- pcall: the write above has happened; a refused announcement (an ACL user without
  -- channel rights) must not turn it into an error. Waiters then poll.
  redis.pcall('PUBLISH', KEYS[1] .. ':rel', ARGV[1])
  return 1
end
return 0
