-- Unique idempotency keys per request: `new` (every request a new key) or `replay` (each wrk
-- thread cycles through 64 keys, each recorded by its first request; a duplicate that comes
-- while that first request is in progress is answered 409, which wrk counts among errors); or
-- `unrecorded`, no key at all, to a route that proxies keyless requests without recording them.
-- The mode comes from the IDEM_WRK_MODE variable.
local mode = os.getenv("IDEM_WRK_MODE") or "new"
-- The path keyed requests go to: a proxy that names its upstream in the path has its own.
local path = os.getenv("IDEM_WRK_PATH") or "/payments"
local body = '{"amount":42}'
local threads = 0
local prefix, n = "", 0

function setup(thread)
  threads = threads + 1
  thread:set("id", threads)
end

function init(args)
  prefix = string.format("%s-%d-%d-%d", mode, os.time(), id, math.random(1, 1e9))
end

function request()
  local key
  if mode == "replay" then
    key = prefix .. "-" .. (n % 64)
  else
    key = prefix .. "-" .. n
  end
  n = n + 1
  if mode == "unrecorded" then
    return wrk.format("POST", "/unrecorded", { ["Content-Type"] = "application/json" }, body)
  end
  return wrk.format("POST", path, { ["Idempotency-Key"] = key, ["Content-Type"] = "application/json" }, body)
end

function done(summary, latency, requests)
  io.write(string.format("RESULT %.0f %d %d %d\n",
    summary.requests / (summary.duration / 1e6),
    latency:percentile(50), latency:percentile(99), summary.errors.status + summary.errors.connect
      + summary.errors.read + summary.errors.write + summary.errors.timeout))
end
