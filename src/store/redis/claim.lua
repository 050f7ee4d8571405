-- Claim KEYS[1] for a request (SPEC §2.4), in one atomic step.
-- ARGV[1] fingerprint (32 raw bytes), ARGV[2] lease token (16 raw bytes),
-- ARGV[3] lease in milliseconds.
-- Fields: s = state ('i' in flight, 'r' response, 'u' unreplayable),
-- f = fingerprint, t = token, st = status, ca = created at (ms),
-- h = header block, b = body.
-- Reply: {1} acquired | {2, pttl} in flight | {3} mismatch
--      | {4, pttl, status, created_at, headers, body} completed
--      | {5, pttl, status, created_at} unreplayable
local key = KEYS[1]
local cur = redis.call('HMGET', key, 's', 'f')
if not cur[1] then
  redis.call('HSET', key, 's', 'i', 'f', ARGV[1], 't', ARGV[2])
  redis.call('PEXPIRE', key, ARGV[3])
  return {1}
end
if cur[2] ~= ARGV[1] then
  return {3}
end
local pttl = redis.call('PTTL', key)
if cur[1] == 'i' then
  return {2, pttl}
end
if cur[1] == 'u' then
  local r = redis.call('HMGET', key, 'st', 'ca')
  return {5, pttl, r[1], r[2]}
end
local r = redis.call('HMGET', key, 'st', 'ca', 'h', 'b')
return {4, pttl, r[1], r[2], r[3], r[4]}
