-- The floor's begin (benches/http/floor.rs): the stored record if there is one, else the lease.
-- KEYS[1]: the record, KEYS[2]: the lease. ARGV[1]: a token, ARGV[2]: the lease in ms.
-- Returns the record (a string, bare: an array reply costs the server more, and a replay is
-- the least a script call can be), 0 (the lease is taken) or 2 (another request holds it).
local record = redis.call('GET', KEYS[1])
if record then
  return record
end
if redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return 0
end
return 2
