-- The fencing token of every commit of a cluster's shard owner, in commit order. Commits of a
-- shard take turns on the fence's row lock (0003), so ids follow commits, and a token older
-- than one before it is a commit the fence should have refused: what a history checker (the
-- nemesis) reads. An owner that takes the shard over trims it to the last 100,000 commits.
CREATE TABLE shard_commits (
    id BIGSERIAL PRIMARY KEY,
    token BIGINT NOT NULL
);
