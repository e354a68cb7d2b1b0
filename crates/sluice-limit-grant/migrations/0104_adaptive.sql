-- Adaptive keys (issue 17): the computed max, its settings and its last
-- change, as a StoredAdaptive protobuf (crates/sluice-limit-grant/src/adaptive.rs).
-- NULL: not an adaptive key.
ALTER TABLE keys ADD COLUMN adaptive bytea;
