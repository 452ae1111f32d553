#!lua name=floor
-- The lease-only floor (scripts/execute_floor.sh, scripts/valkey_instructions.py): the least an
-- execution does in Valkey when a lease is held while the handler runs: no fence, no in-flight
-- tag, no parts, no announcement. `hold` sets leases for complete_min to find.
redis.register_function('begin_min', function(keys, args)
  local state = redis.call('HMGET', keys[2], 'd', 'n')
  if state[1] then return state[1] end
  if redis.call('SET', keys[1], args[1], 'NX', 'PX', args[2]) then return 1 end
  return 0
end)
redis.register_function('complete_min', function(keys, args)
  if redis.call('GET', keys[1]) ~= args[1] then return 0 end
  redis.call('HSET', keys[2], 'd', args[2])
  redis.call('PEXPIRE', keys[2], args[3])
  redis.call('DEL', keys[1])
  return 1
end)
redis.register_function('hold', function(keys, args)
  for i = 0, tonumber(args[1]) - 1 do
    redis.call('SET', string.format('{' .. args[2] .. ':%012d}', i), 'token')
  end
  return 1
end)
