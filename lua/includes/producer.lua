-- producer: an idempotent producer's meta-hash field and state MAC (lua/publish.lua).
-- A producer is named by a secret only its client holds; the field is
-- 'producer:' .. the first 32 hex digits of SHA1(secret), so reading meta shows a
-- digest, never the secret, and a call must present the secret to act as the producer.

-- The field by secret, the secret checked once (32 to 64 characters [0-9a-f]): the same
-- few secrets come every call, and functions keep this table between calls (bounded).
local PRODUCER_FIELDS, producer_fields = {}, 0
local function producer_field(secret)
  local field = PRODUCER_FIELDS[secret]
  if field then return field end
  if #secret < 32 or #secret > 64 or not s_match(secret, '^[0-9a-f]+$') then
    fail('INVALID', 'producer secret must be 32 to 64 lower-case hex digits, got ' .. fmt(#secret)
      .. ' characters')
  end
  if producer_fields >= 1024 then PRODUCER_FIELDS, producer_fields = {}, 0 end
  field = 'producer:' .. s_sub(redis.sha1hex(secret), 1, 32)
  PRODUCER_FIELDS[secret], producer_fields = field, producer_fields + 1
  return field
end

-- The MAC of a state's five numbers ('SEQ FIRST COUNT MS IDLE') under the producer's
-- secret: 16 hex digits of SHA1(secret .. ' ' .. five). Without the secret a state
-- written by hand cannot carry the right one.
local function producer_mac(secret, five)
  return s_sub(redis.sha1hex(secret .. ' ' .. five), 1, 16)
end
