-- Renews a reentrant lock's lease if the hold is still ours. The key is shared by every hold of
-- the owner, each promised its own lease: a renewal only ever raises the key's expiry, so that
-- a hold with a short lease (or a renewal capped by max_hold) never cuts short the lease
-- another hold was promised.
--
-- KEYS[1]  lock key
-- KEYS[2]  state key
-- ARGV[1]  owner id
-- ARGV[2]  new lease in milliseconds
-- ARGV[3]  expiry of the state key in milliseconds, '0' to keep it
-- ARGV[4]  hold token
--
-- Returns 1 if renewed (the key now lives at least the new lease), 0 if the hold is gone.
if redis.call('TYPE', KEYS[1]).ok == 'hash'
    and redis.call('HGET', KEYS[1], 'o') == ARGV[1]
    and redis.call('HEXISTS', KEYS[1], 'h:' .. ARGV[4]) == 1 then
  if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[2]) then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
  end
  if ARGV[3] ~= '0' then
    redis.call('PEXPIRE', KEYS[2], ARGV[3])
  end
  return 1
end
return 0
