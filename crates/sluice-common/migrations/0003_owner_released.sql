-- An owner that gives its partition up in order (revoked, stopping) marks its
-- row released, so that a member standing by for the partition (it was fenced
-- while the group still assigned the partition to it) takes it at once instead
-- of waiting for the row to fall silent. A takeover clears it.
ALTER TABLE owners ADD COLUMN released boolean NOT NULL DEFAULT false;
