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
--          kept beside the store drop it. (pcall: a user without channel rights still purges;
--          a cache cannot subscribe under such a user either, and serves nothing.)
--
-- Returns {0, lock PTTL} when a lease holds the name (nothing deleted), {1, keys deleted,
-- announced} otherwise (0 keys: there was nothing; announced 0 when the PUBLISH was refused).
local pttl = redis.call('PTTL', KEYS[1])
if pttl ~= -2 then
  return {0, pttl}
end
local announced = 1
if redis.call('PTTL', KEYS[2]) ~= -2 then
  local published = redis.pcall('PUBLISH', ARGV[1], ARGV[2])
  if type(published) == 'table' and published.err then
    announced = 0
  end
end
return {1, redis.call('DEL', KEYS[2], KEYS[3]), announced}
