-- (Redlock) Reads a one-part completion record that begin.lua named by its length and digest
-- instead of sending it, only if it is still that record (read only).
--
-- KEYS[1]  state key (see begin.lua)
-- ARGV[1]  the record's SHA-1, in hex, as begin.lua gave it
--
-- Returns the record, or nil when the state holds no record or another one.
local record = redis.call('HMGET', KEYS[1], 'd', 'h')
if record[1] and (record[2] or redis.sha1hex(record[1])) == ARGV[1] then
  return record[1]
end
return false
