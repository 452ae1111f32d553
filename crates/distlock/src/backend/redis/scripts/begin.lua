-- Begins a once-lock: returns its completion record if it was completed, else takes it if it
-- is free (with its fencing counter, storing the holder's tag, and clearing the parts an
-- abandoned writer left), else reports the holder.
--
-- KEYS[1]  lock key: a string holding the owner token, with the lease as its expiry
-- KEYS[2]  state key: a hash with n = fencing counter, m = the holder's tag (once a record is
--          stored, the token that completed it: complete.lua), t = since when the holder holds
--          (ARGV[5]), d = a one-part completion record, p = the part count of a complete
--          streamed record, and (Redlock masters, records longer than they send with an answer)
--          l = the record's length, h = its SHA-1 in hex. (c = the completing token, in records
--          an earlier version stored.)
-- KEYS[3]  parts key: a list, the parts of a streamed record (absent for one-part records).
--          All keys share one {hash tag}.
-- ARGV[1]  owner token (unique per attempt)
-- ARGV[2]  lease in milliseconds
-- ARGV[3]  expiry of the state key (the record retention) in milliseconds
-- ARGV[4]  the holder's tag (e.g. a request fingerprint), shown to contenders
-- ARGV[5]  where a new fencing counter starts: the caller's clock, in microseconds
-- ARGV[6]  (Redlock masters) the largest one-part record sent with the answer, in bytes;
--          absent: any
--
-- Returns, the common answers bare (an array reply costs the server more than the rest of the
-- call): the record (a string) when completed in one part; the fence (an integer) when taken.
-- Otherwise an array: {3, length, SHA-1 in hex} when completed in one part longer than ARGV[6]
-- (read it with record.lua), {2, first part (nil if missing), parts} when completed streamed,
-- {0, pttl, tag, holder's fence, parts appended} when held.
local inline = tonumber(ARGV[6])
if inline then
  -- A large record's size and digest, stored with it (complete.lua): named without reading it.
  local named = redis.call('HMGET', KEYS[2], 'l', 'h')
  if named[2] and tonumber(named[1]) > inline then
    return {3, tonumber(named[1]), named[2]}
  end
end
local state = redis.call('HMGET', KEYS[2], 'd', 'p', 'n')
if state[1] then
  if inline and #state[1] > inline then
    -- Stored without its size and digest (by an earlier version).
    return {3, #state[1], redis.sha1hex(state[1])}
  end
  return state[1]
end
if state[2] then
  return {2, redis.call('LINDEX', KEYS[3], '0'), tonumber(state[2])}
end
-- The counter expires with the record. Started again from 0 it would hand the next run the
-- fence of a run already stored, and parts bound to their writer's fence would be
-- interchangeable between the two: a new counter starts from the caller's clock instead.
-- (Below 2^53: exact as a Lua number, written back as an integer with '%.0f'. Not '%d', which
-- is cheaper but casts to a C long: 32 bits on a 32-bit server, which would mangle the fence.)
local fence = (tonumber(state[3]) or tonumber(ARGV[5])) + 1
-- One command checks and takes. (SET NX finds any key, also a reentrant lock's hash.)
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  -- All or nothing: a state write the server refuses (a command the ACL user may not run)
  -- gives the lock back before the error is returned, so that no lock is left behind, held by
  -- nobody for a whole lease.
  local written = redis.pcall('HSET', KEYS[2], 'n', string.format('%.0f', fence), 'm', ARGV[4],
    't', ARGV[5])
  if type(written) == 'table' and written.err then
    redis.call('DEL', KEYS[1])
    return written
  end
  written = redis.pcall('PEXPIRE', KEYS[2], ARGV[3])
  if type(written) == 'table' and written.err then
    redis.call('DEL', KEYS[1])
    return written
  end
  -- A new writer starts from no parts (a no-op unless a writer died mid-stream). Always: no
  -- mark that parts exist can be trusted to be there (an evicted state, another version's
  -- append), and a writer that inherited a dead one's parts would serve them as its own.
  written = redis.pcall('DEL', KEYS[3])
  if type(written) == 'table' and written.err then
    redis.call('DEL', KEYS[1])
    return written
  end
  return fence
end
-- (pcall: a lock key of another type, a reentrant lock of the same name, is held.)
local holder = redis.pcall('GET', KEYS[1])
-- The same call sent again (a cluster client resends a command whose connection broke before
-- its reply) finds its own token: taken, with the fence it drew.
if holder == ARGV[1] then
  return tonumber(state[3])
end
return {0, redis.call('PTTL', KEYS[1]), redis.call('HGET', KEYS[2], 'm') or '',
  tonumber(state[3]) or 0, redis.call('LLEN', KEYS[3])}
