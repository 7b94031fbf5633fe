-- A provider's usage report counts in the spend ledger and the budgets
-- whatever its kind's wire format names the tokens: OpenAI's `total_tokens`,
-- else `prompt_tokens` + `completion_tokens`; Anthropic's `input_tokens` +
-- `output_tokens`, with the prompt cache's input tokens
-- (`cache_creation_input_tokens`, `cache_read_input_tokens`), which its
-- `input_tokens` leaves out. The report is outside text: anything that is not
-- a number counts 0, and the sum is held to 0 .. 10^15. The ledger's trigger
-- (migration 0021) calls this function, so it counts this way from now on;
-- usage recorded before counted 0 where it named only Anthropic's fields.
CREATE OR REPLACE FUNCTION usage_tokens(usage jsonb) RETURNS bigint
LANGUAGE sql IMMUTABLE AS $$
    SELECT LEAST(GREATEST(COALESCE(
        CASE WHEN jsonb_typeof(usage -> 'total_tokens') = 'number'
             THEN (usage ->> 'total_tokens')::numeric END,
        (SELECT COALESCE(sum((usage ->> f)::numeric), 0)
         FROM unnest(ARRAY['prompt_tokens', 'completion_tokens',
                           'input_tokens', 'output_tokens',
                           'cache_creation_input_tokens',
                           'cache_read_input_tokens']) AS f
         WHERE jsonb_typeof(usage -> f) = 'number')
    ), 0), 1e15)::bigint
$$;
