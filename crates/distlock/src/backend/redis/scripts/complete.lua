-- Completes a once-lock: stores the record and releases the lock, only if the lock still holds
-- our token. A holder whose lease was lost stores nothing. The completing token is kept with
-- the record, so that a retry of a completion whose reply was lost (a failover, a dropped
-- connection) is recognised as done rather than refused. It is kept in the field that held the
-- holder's tag (m): a record has no holder, and overwriting the tag in the write that stores the
-- record costs a command less than deleting it (an empty field would cost every stored record
-- some 40 bytes in Redis for its whole retention). So m names the completing token only beside
-- a record (d or p, written with it): without one it is a holder's tag, whatever its bytes (a
-- caller may pass any tag, a token it saw among them). (Records an earlier version completed
-- keep the token in c, and no m.)
--
-- Without appends (ARGV[4] = '0') the record is one part, in the state hash (d). After appends
-- the record is the last part, pushed after the others, and p = the part count marks the
-- streamed record done; the list must hold exactly the parts appended. ARGV[4] = '-1': a
-- one-part record in place of the parts appended, which are deleted (a writer whose parts
-- broke stores what it can say instead).
--
-- KEYS[1]  lock key
-- KEYS[2]  state key
-- KEYS[3]  parts key
-- ARGV[1]  owner token
-- ARGV[2]  the record (one part), or the last part
-- ARGV[3]  retention of the record in milliseconds
-- ARGV[4]  parts appended before, '0' for a one-part record, '-1' for one replacing the parts
-- ARGV[5]  (Redlock masters) the largest one-part record begin.lua sends with its answer: a
--          longer one is stored with its length (l) and SHA-1 (h), which begin.lua answers
--          with instead. Absent: no such record.
--
-- Returns 1 if stored (now or by an earlier attempt with this token), 0 if the lock was not
-- ours any more, -1 - n if n parts are stored instead of ARGV[4] (nothing is touched).
local function one_part()
  local inline = tonumber(ARGV[5])
  if inline and #ARGV[2] > inline then
    redis.call('HSET', KEYS[2], 'd', ARGV[2], 'm', ARGV[1], 'l', #ARGV[2], 'h',
      redis.sha1hex(ARGV[2]))
  else
    redis.call('HSET', KEYS[2], 'd', ARGV[2], 'm', ARGV[1])
  end
end
if redis.pcall('GET', KEYS[1]) == ARGV[1] then
  if ARGV[4] == '0' then
    one_part()
  elseif ARGV[4] == '-1' then
    redis.call('DEL', KEYS[3])
    redis.call('HDEL', KEYS[2], 'p')
    one_part()
  else
    local stored = redis.call('LLEN', KEYS[3])
    if stored ~= tonumber(ARGV[4]) then
      return -1 - stored
    end
    redis.call('RPUSH', KEYS[3], ARGV[2])
    redis.call('HSET', KEYS[2], 'p', stored + 1, 'm', ARGV[1])
  end
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
  -- The parts' retention after the state's: Redis (before 7.2) reads its clock per command in a
  -- script, and parts that expired a millisecond before the state saying done would make a
  -- replay unreadable instead of a fresh run.
  if ARGV[4] ~= '0' and ARGV[4] ~= '-1' then
    redis.call('PEXPIRE', KEYS[3], ARGV[3])
  end
  redis.call('DEL', KEYS[1])
  -- Announced always: whoever waits (a duplicate, a reader following the parts, a client of
  -- another version) cannot be known here without a mark every waiter would have to write.
  -- pcall: the write above has happened; a refused announcement (an ACL user without channel
  -- rights) must not turn it into an error. Waiters then poll.
  redis.pcall('PUBLISH', KEYS[1] .. ':rel', ARGV[1])
  return 1
end
local done = redis.call('HMGET', KEYS[2], 'm', 'd', 'p')
if done[1] == ARGV[1] and (done[2] or done[3]) then
  -- A retry of a completion whose reply was lost: done. The retention is refreshed: a write,
  -- so that a replica check (WAIT) sent after this call on a new connection waits for its
  -- replication, which a replica can only acknowledge after the record's (Valkey answers a
  -- WAIT on a connection that wrote nothing at once, counting a frozen replica). The parts of
  -- a streamed record get it too: they must never expire before the state that says done.
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
  redis.call('PEXPIRE', KEYS[3], ARGV[3])
  return 1
end
return 0
