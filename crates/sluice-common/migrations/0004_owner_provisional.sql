-- An instance started on the address of a killed one resumes the partitions
-- that one held before the consumer group reassigns them: it owns them
-- provisionally, and whichever member the group assigns one to takes it over
-- at once (as from an owner that released it). Unlike a release, a
-- provisional row is resumed again if its owner is killed in turn. A
-- takeover sets it.
ALTER TABLE owners ADD COLUMN provisional boolean NOT NULL DEFAULT false;
