-- Forget KEYS[1]: delete a completed record; an in-flight claim only if
-- ARGV[1] is '1' (forced: the holder's fenced completion then finds its
-- token gone). Reply: 0 nothing, 1 completed deleted, 2 in flight (left
-- alone), 3 in flight deleted.
local cur = redis.call('GET', KEYS[1])
if not cur then
  return 0
end
if string.byte(cur, 1) == 105 then
  if ARGV[1] ~= '1' then
    return 2
  end
  redis.call('DEL', KEYS[1])
  return 3
end
redis.call('DEL', KEYS[1])
return 1
