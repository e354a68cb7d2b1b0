-- Fair sharing inside a key: the weights of a key's flows (fairness keys)
-- that do not have the default weight, as {"fairness key": weight}.
ALTER TABLE keys ADD COLUMN flow_weights jsonb NOT NULL DEFAULT '{}'::jsonb;
