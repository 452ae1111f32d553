-- Checks, without running any of them, that the Redis user may run every command the lock sends
-- on this client's keys (from its scripts, and SET NX PX with HINCRBY pipelined on one Redis):
-- for LockClient::prepare, so that a user refused one is told at startup, with the command
-- named, rather than by the first operation that needs it; and whether the user may read the
-- eviction policy (CONFIG GET), so that CONFIG is not sent to a user refused it. Read only, and
-- nothing reaches the ACL log. Needs redis.acl_check_cmd (Redis 7, Valkey); an older server
-- answers that it cannot tell. (PUBLISH is not checked: announcements are optional, waiters
-- then poll.)
--
-- KEYS[1]  lock key (of the lock prepare() checks with)
-- KEYS[2]  state key
-- KEYS[3]  parts key. All keys share one {hash tag}.
--
-- Returns {command, why, config}: the first command refused ('' if none, or if the server
-- cannot tell), why: 'acl' (the user may not run it on these keys) or 'unknown' (the server
-- does not offer it: renamed or disabled), and config: 1 if the user may run CONFIG GET, 0 if
-- not (or the server does not offer it), -1 if the server cannot tell.
local check = redis.acl_check_cmd
if not check then
  return {'', '', -1}
end
local lock, state, parts = KEYS[1], KEYS[2], KEYS[3]
local commands = {
  -- Exclusive locks: the lock's string, the fencing counter in the state hash.
  {'GET', lock}, {'SET', lock, 't', 'NX', 'PX', '1'}, {'PTTL', lock}, {'PEXPIRE', lock, '1'},
  {'DEL', lock}, {'TYPE', lock}, {'HINCRBY', state, 'n', '1'}, {'HGET', state, 'n'},
  {'PEXPIRE', state, '1'}, {'HSETNX', state, 'n', '1'},
  -- Reentrant locks: a hash at the lock key.
  {'HSET', lock, 'h', '1'}, {'HGET', lock, 'o'}, {'HDEL', lock, 'h'}, {'HEXISTS', lock, 'h'},
  {'HLEN', lock},
  -- Run-once records: the state hash and the parts list.
  {'HMGET', state, 'd', 'p'}, {'HSET', state, 'd', 'r'}, {'HDEL', state, 'p'},
  {'RPUSH', parts, 'p'}, {'LLEN', parts}, {'LINDEX', parts, '0'}, {'LRANGE', parts, '0', '1'},
  {'DEL', parts}, {'PEXPIRE', parts, '1'},
}
for _, command in ipairs(commands) do
  local known, allowed = pcall(check, unpack(command))
  if not known then
    return {command[1], 'unknown', 0}
  end
  if not allowed then
    return {command[1], 'acl', 0}
  end
end
local known, config = pcall(check, 'CONFIG', 'GET', 'maxmemory-policy')
return {'', '', (known and config) and 1 or 0}
