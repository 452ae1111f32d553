-- wrk script for the HTTP bench's server (`--serve <variant>`, see docs/BENCHMARKS.md, "Method"):
-- POST /pay with a small JSON body and a new Idempotency-Key on every request (execute path).
--   wrk -t1 -c1 -d3s --latency -s benches/wrk/new_keys.lua http://127.0.0.1:<port>/pay
local counter = 0
local run = tostring(os.time())

request = function()
  counter = counter + 1
  local headers = {}
  headers["Content-Type"] = "application/json"
  headers["Idempotency-Key"] = "wrk-" .. run .. "-" .. tostring(math.random(1, 1000000000)) .. "-" .. counter
  return wrk.format("POST", "/pay", headers, '{"amount":100,"currency":"eur"}')
end
