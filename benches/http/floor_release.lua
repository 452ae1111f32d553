-- The floor's release (benches/http/floor.rs): frees the lease if it is still this token's.
-- KEYS[1]: the lease. ARGV[1]: the token. Returns 1 if freed.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
