-- Claim KEYS[1] for a request, in one atomic step.
-- ARGV[1] the in-flight record to create: 'i' .. fingerprint (32 bytes) .. token (16 bytes)
-- ARGV[2] the request's fingerprint (32 bytes); ARGV[3] lease in milliseconds.
-- Reply: {1} acquired | {2, pttl, token} in flight | {3} mismatch | {4, pttl, record} completed
-- (The in-flight token lets a client recognise its own claim sent twice.)
-- (SET NX GET needs Redis 7.0: it creates the claim, or returns what is there.)
local cur = redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[3], 'GET')
if not cur then
  return {1}
end
if string.sub(cur, 2, 33) ~= ARGV[2] then
  return {3}
end
local pttl = redis.call('PTTL', KEYS[1])
if string.byte(cur, 1) == 105 then -- 'i'
  return {2, pttl, string.sub(cur, 34, 49)}
end
return {4, pttl, cur}
