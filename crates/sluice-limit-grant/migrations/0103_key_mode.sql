-- Shadow mode: a key's stored mode (sluice.v1.LimitMode: 1 enforce, 2
-- shadow); NULL: the jobs' own shadow flags decide.
ALTER TABLE keys ADD COLUMN mode smallint;
