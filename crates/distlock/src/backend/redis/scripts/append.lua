-- Appends part ARGV[2] (0-based) of a once-lock's streamed record, only if the lock still holds
-- our token. Idempotent: the caller says which index the part is; if the list already holds
-- that very part at that index as its last, this is a retry of an append whose reply was lost,
-- and it is acknowledged without a second copy. Refreshes the retention of every key of the
-- record and announces the progress ('+' and the index: never a token, so it frees no waiting
-- acquirer) so that readers wake.
--
-- KEYS[1]  lock key
-- KEYS[2]  state key
-- KEYS[3]  parts key. All keys share one {hash tag}.
-- ARGV[1]  owner token
-- ARGV[2]  index of the part
-- ARGV[3]  the part
-- ARGV[4]  retention of the record in milliseconds
--
-- Returns 1 if the part is stored at its index (now or by an earlier attempt), 0 if the lock is
-- not ours (nothing appended), -1 - n if the list holds n parts and not this one at its index
-- (nothing appended).
if redis.pcall('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
local stored = redis.call('LLEN', KEYS[3])
local index = tonumber(ARGV[2])
if stored == index then
  redis.call('RPUSH', KEYS[3], ARGV[3])
elseif stored ~= index + 1 or redis.call('LINDEX', KEYS[3], index) ~= ARGV[3] then
  return -1 - stored
end
redis.call('PEXPIRE', KEYS[2], ARGV[4])
redis.call('PEXPIRE', KEYS[3], ARGV[4])
-- pcall: the append has happened; a refused announcement must not turn it into an error.
redis.pcall('PUBLISH', KEYS[1] .. ':rel', '+' .. ARGV[2])
return 1
