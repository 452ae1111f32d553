-- Deletes a name's run-once record (its state and parts) unless a lease holds the name: a
-- purge never lets a second execution start beside the one running (the holder is left alone;
-- purge again once it has ended). The fencing counter goes with the state: the next holder's
-- starts from its clock, still above the ones handed out before.
--
-- KEYS[1]  lock key
-- KEYS[2]  state key
-- KEYS[3]  parts key
--          All keys share one {hash tag}.
-- ARGV[1]  the purge channel (LockClient::purge_channel)
-- ARGV[2]  the name, announced there when a record is deleted: caches of completed records
--          kept beside the store drop it. Announced before the DEL, so that a refused PUBLISH
--          deletes nothing (a purge that no cache hears of would leave the record replayed).
--
-- Returns {0, lock PTTL} when a lease holds the name (nothing deleted), {1, keys deleted}
-- otherwise (0: there was nothing).
local pttl = redis.call('PTTL', KEYS[1])
if pttl ~= -2 then
  return {0, pttl}
end
if redis.call('PTTL', KEYS[2]) ~= -2 then
  redis.call('PUBLISH', ARGV[1], ARGV[2])
end
return {1, redis.call('DEL', KEYS[2], KEYS[3])}
