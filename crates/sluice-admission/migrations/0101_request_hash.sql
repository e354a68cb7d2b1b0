-- A fingerprint (SHA-256) of each job's request as saved, spec and payload:
-- the same job id sent again with a different request is a conflict
-- (dead-lettered with reason `conflict`, gRPC ALREADY_EXISTS), not a silent
-- duplicate. NULL for jobs saved before fingerprints were kept.
ALTER TABLE jobs ADD COLUMN request_hash bytea;
