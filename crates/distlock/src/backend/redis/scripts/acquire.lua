-- Takes an exclusive lock if it is free, atomically with its fencing counter. Kept to the
-- minimum, with an integer reply. Sent to Redlock masters (whose fences the client combines), a
-- Cluster, a Sentinel-managed master, and with replica acknowledgements (`WAIT` behind it); on
-- one Redis reached directly, a fenced acquisition is `SET NX PX` with the `HINCRBY` behind it
-- in one pipeline (`RedisBackend::acquire_plain`).
--
-- All or nothing: the fence is drawn (and the state's expiry set) before the lock is taken, so
-- a draw that fails (the state key holds another type, the counter is not an integer, the ACL
-- user may not run HINCRBY or PEXPIRE) leaves no lock behind, held by nobody for a whole lease.
-- Nothing runs between the look and the SET (a script is atomic); a number drawn for a lock
-- then not taken (SET refused) is only burnt: fences must increase, not be dense.
--
-- KEYS[1]  lock key: a string holding the owner token, with the lease as its expiry
-- KEYS[2]  state key: a hash with n = fencing counter. Both keys share one {hash tag}.
-- ARGV[1]  owner token (unique per acquisition)
-- ARGV[2]  lease in milliseconds
-- ARGV[3]  expiry of the state key in milliseconds, '0' to keep it
-- ARGV[4]  where a counter that expires starts when made again: the caller's clock, in
--          microseconds (from 0, it would repeat the fences given before it expired)
--
-- Returns the fence (>= 1) when taken. When another owner holds the lock, returns
-- -1 - pttl: -1 - the remaining lease in ms, or 0 if the lock has no expiry. The same call
-- sent again (a cluster client resends a command whose connection broke before its reply)
-- finds its own token: taken, with the fence it drew (nobody else drew one since).
-- (pcall: a lock key of another type, a reentrant lock of the same name, is held.)
local holder = redis.pcall('GET', KEYS[1])
if not holder then
  if ARGV[3] ~= '0' then
    redis.call('HSETNX', KEYS[2], 'n', ARGV[4])
  end
  local fence = redis.call('HINCRBY', KEYS[2], 'n', '1')
  if ARGV[3] ~= '0' then
    redis.call('PEXPIRE', KEYS[2], ARGV[3])
  end
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return fence
end
if holder == ARGV[1] then
  return tonumber(redis.call('HGET', KEYS[2], 'n'))
end
return -1 - redis.call('PTTL', KEYS[1])
