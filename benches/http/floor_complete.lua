-- The floor's completion (benches/http/floor.rs): stores the record if the lease is still this
-- token's, and frees the lease. KEYS[1]: the record, KEYS[2]: the lease. ARGV[1]: the token,
-- ARGV[2]: the record, ARGV[3]: its retention in ms. Returns 1 if stored, 0 if the lease was lost.
if redis.call('GET', KEYS[2]) ~= ARGV[1] then
  return 0
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
redis.call('DEL', KEYS[2])
return 1
